"""CUDA C++ kernels compiled at run time with NVRTC (no user build step), and a thin launcher.

The sources are ``.cu`` / ``.cuh`` files in ``csrc`` (package data). :func:`compile_kernel` names a kernel by its
file and ``extern "C"`` name and returns it loaded for a device (compiled once a process, CUBINs also cached on
disk); ``runtime`` compiles with NVRTC and launches through the driver API on the current torch stream (so CUDA
graphs capture it). ``available()`` says whether this works here; every caller falls back to the Triton kernels
when it does not.
"""

from kbit.cuda.runtime import available
from kbit.cuda.sources import compile_kernel

__all__ = ["available", "compile_kernel"]
