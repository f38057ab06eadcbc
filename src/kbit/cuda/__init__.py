"""CUDA C++ kernels compiled at run time with NVRTC (no user build step), and a thin launcher.

``runtime`` finds NVRTC (the library torch ships), compiles a source with ``#define`` options to a CUBIN for the
current device, caches the loaded module per (source hash, options, device) and launches through the driver API
on the current torch stream (so CUDA graphs capture it). ``available()`` says whether this works here; every
caller falls back to the Triton kernels when it does not. :func:`compile_kernel` names a kernel by its source
file and ``extern "C"`` name.
"""

from kbit.cuda.runtime import available
from kbit.cuda.sources import compile_kernel

__all__ = ["available", "compile_kernel"]
