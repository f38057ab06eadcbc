"""Kernels by (``.cu`` file, ``extern "C"`` name): the one way the layers above compile a CUDA kernel.

The CUDA C++ lives in ``kbit/cuda/csrc`` (package data): one ``.cu`` file a kernel family, shared device code in
``.cuh`` headers that NVRTC reads through ``#include "name.cuh"`` (every header of the folder is handed to it, so
compile errors name the real file and line). Compile-time variants are ``-D`` options; each ``.cu`` file documents
its defines at its top. :func:`compile_kernel` compiles a file once per (defines, device) and process (the CUBIN
also goes to the on-disk cache, :func:`kbit.cuda.runtime.compile_cached`) and returns the loaded kernel from a
dictionary afterwards, so callers keep no kernel caches of their own.
"""

from __future__ import annotations

import functools
import os
import threading

import torch

from kbit import options
from kbit.cuda import runtime
from kbit.cuda.runtime import Kernel

#: the folder of the ``.cu`` / ``.cuh`` files
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")

#: every kernel by file: the ``extern "C"`` names each ``.cu`` file defines
KERNELS = {
    "gemv_mma_split.cu": ("kbit_gemv_mma_split",),
    "gemv_mma_streamk.cu": ("kbit_gemv_mma_streamk",),
    "mma_pipe.cu": ("kbit_mma_pipe",),
    "grouped_mma_pipe.cu": ("kbit_grouped_mma_pipe",),
    "wgmma.cu": ("kbit_wgmma",),
    "x_tiles.cu": ("kbit_x_tiles", "kbit_x_tiles_g", "kbit_x_tiles_silu_g"),
    "dequant_mma.cu": ("kbit_deq_mma",),
    "moe_blocks.cu": ("kbit_moe_blocks", "kbit_moe_blocks_off", "kbit_moe_split", "kbit_moe_split_rows"),
    "grouped_mma.cu": ("kbit_grouped_mma",),
    "dequant.cu": ("kbit_dequant",),
    "read.cu": ("kbit_read",),
}

#: files compiled for the arch-specific target (``sm_90a``: wgmma and the other features of that GPU only)
ARCH_SPECIFIC = frozenset({"wgmma.cu"})

_LOCK = threading.Lock()
_KERNELS: dict = {}  # (file, name, defines, device index, nvrtc_lib) -> Kernel
_MODULES: dict = {}  # (file, defines, device index, nvrtc_lib) -> (module, cubin)


@functools.cache
def read_source(file: str) -> str:
    """The text of ``csrc/<file>``."""
    with open(os.path.join(CSRC, file), encoding="utf-8") as f:
        return f.read()


@functools.cache
def headers() -> dict:
    """{name: text} of every ``.cuh`` header in ``csrc`` (what an ``#include "name"`` of a kernel file reads)."""
    return {f: read_source(f) for f in sorted(os.listdir(CSRC)) if f.endswith(".cuh")}


def define_options(defines: dict) -> tuple:
    """``-D`` options of ``defines`` (bools as 0 / 1), sorted by name."""
    return tuple(f"-D{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(defines.items()))


def compile_source(file: str, defines: dict, arch: str) -> bytes:
    """The CUBIN of ``csrc/<file>`` with ``defines`` for ``arch`` (e.g. ``"sm_90a"``), through the on-disk cache;
    needs NVRTC only (no GPU)."""
    return runtime.compile_cached(read_source(file), arch, define_options(defines), name=file, headers=headers())


def compile_kernel(file: str, name: str, defines: dict, device) -> Kernel:
    """Kernel ``name`` of ``csrc/<file>`` compiled with ``defines`` (``-D`` options) for ``device`` and loaded:
    compiled once a process (the CUBIN also cached on disk), then a dictionary look-up."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    lib = options.get().nvrtc_lib
    key = (file, name, tuple(sorted(defines.items())), index, lib)
    hit = _KERNELS.get(key)
    if hit is not None:
        return hit
    if name not in KERNELS.get(file, ()):
        raise ValueError(f"kernel: expected a (file, name) of {sorted(KERNELS.items())}, got {(file, name)}")
    with _LOCK:
        hit = _KERNELS.get(key)
        if hit is None:
            dev = torch.device("cuda", index)
            mod, cubin = _module(file, key[2], dev, lib)
            hit = _KERNELS[key] = runtime.get_kernel(mod, cubin, name, dev)
        return hit


def _module(file: str, defines: tuple, device: torch.device, lib) -> tuple:
    """The loaded module of ``file`` with ``defines`` on ``device`` (one for all the file's kernels)."""
    key = (file, defines, device.index, lib)
    hit = _MODULES.get(key)
    if hit is None:
        arch = runtime.device_arch(device, file in ARCH_SPECIFIC)
        source, opts, hdrs = read_source(file), define_options(dict(defines)), headers()
        cubin, cached = runtime._compile_cached(source, arch, opts, file, hdrs, False)
        rebuild = (lambda: runtime.compile_cached(source, arch, opts, name=file, headers=hdrs, refresh=True)) \
            if cached else None  # a cached CUBIN this driver cannot load: compile it afresh
        hit = _MODULES[key] = runtime.load_module(cubin, device, rebuild)
    return hit
