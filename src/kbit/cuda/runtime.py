"""NVRTC compile + driver-API launch (ctypes).

The launcher packs all arguments into one buffer (``CU_LAUNCH_PARAM_BUFFER_POINTER``), so a launch costs one
``struct.pack`` and one ``cuLaunchKernel`` call; it runs on ``torch.cuda.current_stream()`` and is therefore
captured by CUDA graphs like any torch kernel.

Settings come from :mod:`kbit.options`: ``nvrtc_lib`` may name the NVRTC shared library (a CPU machine can then
compile CUBINs to read SASS; default: the one torch loads, ``torch.cuda._utils._get_gpu_rtc_library``),
``cache_dir`` is the on-disk CUBIN cache (None: off), ``cuda_kernels`` and ``interpret`` turn the CUDA kernels
off, ``pdl`` allows programmatic dependent launch.

Compiled CUBINs are kept on disk (:func:`compile_cached`), so a new process loads a kernel it has compiled before
instead of compiling it again (a wgmma kernel build takes tens of seconds of CPU). :mod:`kbit.cuda.sources` names
kernels by their ``.cu`` file and caches the loaded ones.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import os
import site
import struct
import threading
import uuid

import torch
from torch.cuda import _utils as _torch_cuda_utils

from kbit import options


class NvrtcError(RuntimeError):
    pass


def _nvrtc():
    return _nvrtc_at(options.get().nvrtc_lib)


@functools.cache
def _nvrtc_at(path: str | None):
    """The NVRTC library at ``path``, else torch's (or one in the nvidia wheels next to torch)."""
    if path:
        return ctypes.CDLL(path)
    try:
        return _torch_cuda_utils._get_gpu_rtc_library()
    except OSError:  # not on the loader path: look in the nvidia wheels next to torch
        for d in site.getsitepackages():
            for f in sorted(glob.glob(os.path.join(d, "nvidia", "**", "libnvrtc.so*"), recursive=True)):
                if "builtins" not in f and "alt" not in f:
                    return ctypes.CDLL(f)
        raise


@functools.cache
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def available() -> bool:
    """True when a CUDA device, the driver and NVRTC are all usable and the options allow the CUDA kernels
    (``cuda_kernels`` on, not ``interpret``)."""
    return _available(options.get())


@functools.cache
def _available(opts: options.Options) -> bool:
    if not opts.cuda_kernels or opts.interpret:
        return False
    if not torch.cuda.is_available() or torch.version.hip:
        return False
    try:
        _nvrtc_at(opts.nvrtc_lib)
        _libcuda()
    except Exception:  # noqa: BLE001 - any failure to load means "not available"
        return False
    return True


def _check_nvrtc(lib, res, what):
    if res != 0:
        s = ctypes.c_char_p()
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        msg = lib.nvrtcGetErrorString(res)
        raise NvrtcError(f"NVRTC {what} failed: {msg!r} ({s})")


def _check_cu(res, what):
    if res != 0:
        name = ctypes.c_char_p()
        _libcuda().cuGetErrorName(res, ctypes.byref(name))
        raise RuntimeError(f"CUDA driver {what} failed: {name.value!r} ({res})")


def nvrtc_compile(source: str, arch: str, options=(), name: str = "kbit.cu",
                  headers: dict | None = None) -> tuple[bytes, str]:
    """Compile ``source`` (its file name ``name``, for messages) for ``arch`` (e.g. ``"sm_90"``) to a CUBIN with
    ``options`` (e.g. ``-D`` defines) and ``headers`` ({include name: text}, what ``#include "name"`` reads);
    returns (cubin, log)."""
    return _nvrtc_output(source, arch, options, name, headers, "CUBIN")


def nvrtc_ptx(source: str, arch: str, options=(), name: str = "kbit.cu", headers: dict | None = None) -> str:
    """:func:`nvrtc_compile`'s PTX instead of the CUBIN (``arch`` a virtual one, e.g. ``"compute_90"``): what
    ptxas was given, to compare with the SASS it made (``tests/pdl_scan.py``)."""
    ptx, _log = _nvrtc_output(source, arch, options, name, headers, "PTX")
    return ptx.rstrip(b"\0").decode()


def _nvrtc_output(source, arch, options, name, headers, what: str) -> tuple[bytes, str]:
    """(the program's ``what`` output, ``"CUBIN"`` or ``"PTX"``, log) of one NVRTC compile."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    headers = headers or {}
    texts = (ctypes.c_char_p * len(headers))(*[t.encode() for t in headers.values()])
    names = (ctypes.c_char_p * len(headers))(*[n.encode() for n in headers])
    _check_nvrtc(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), len(headers),
                                             texts, names), "create")
    try:
        opts = [f"--gpu-architecture={arch}", "--std=c++17", "-default-device", *options]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        res = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        log_s = log.value.decode(errors="replace")
        if res != 0:
            raise NvrtcError(f"NVRTC compile failed ({arch}, {opts}):\n{log_s}")
        _check_nvrtc(lib, getattr(lib, f"nvrtcGet{what}Size")(prog, ctypes.byref(size)), f"get {what} size")
        buf = ctypes.create_string_buffer(size.value)
        _check_nvrtc(lib, getattr(lib, f"nvrtcGet{what}")(prog, buf), f"get {what}")
        return buf.raw, log_s
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC in use (``options.get().nvrtc_lib``)."""
    return _nvrtc_version_at(options.get().nvrtc_lib)


@functools.cache
def _nvrtc_version_at(path: str | None) -> tuple[int, int]:
    lib, major, minor = _nvrtc_at(path), ctypes.c_int(), ctypes.c_int()
    _check_nvrtc(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "version")
    return major.value, minor.value


def cache_dir() -> str | None:
    """The on-disk CUBIN cache's folder (``options.get().cache_dir``), or None where it is off."""
    return options.get().cache_dir


def _cache_path(source: str, arch: str, options, headers: dict | None = None) -> str | None:
    d = cache_dir()
    if d is None:
        return None
    major, minor = nvrtc_version()
    parts = [source, arch, *options, f"nvrtc {major}.{minor}"]
    for name in sorted(headers or {}):  # every header's text: a header change must not load an old CUBIN
        parts += [name, headers[name]]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()
    return os.path.join(d, key[:2], key + ".cubin")


def compile_cached(source: str, arch: str, options=(), *, name: str = "kbit.cu", headers: dict | None = None,
                   refresh: bool = False) -> bytes:
    """:func:`nvrtc_compile`'s CUBIN, read from the on-disk cache where an earlier process wrote it (the key: the
    whole source, ``arch``, ``options``, every header's name and text and the NVRTC version); ``refresh`` compiles
    and rewrites it. A cache that cannot be read or written is skipped (the CUBIN is compiled as without one); a
    cache file whose length or SHA-256 does not match its header is deleted and compiled again
    (:func:`read_cache_file`)."""
    return _compile_cached(source, arch, options, name, headers, refresh)[0]


def _compile_cached(source: str, arch: str, options, name: str, headers: dict | None,
                    refresh: bool) -> tuple[bytes, bool]:
    """:func:`compile_cached`, and whether the CUBIN came from the cache."""
    path = _cache_path(source, arch, options, headers)
    if path is not None and not refresh:
        cubin = read_cache_file(path)
        if cubin is not None:
            return cubin, True
    cubin, _ = nvrtc_compile(source, arch, options, name, headers)
    if path is not None:
        write_cache_file(path, cubin)
    return cubin, False


#: a cache file: CACHE_MAGIC, the CUBIN's length (8 bytes, little-endian), its SHA-256, then the CUBIN
CACHE_MAGIC = b"kbitCUB1"
_CACHE_HEADER = struct.Struct("<8sQ32s")


def read_cache_file(path: str) -> bytes | None:
    """The CUBIN stored at ``path`` by :func:`write_cache_file`, or None where there is none or it is damaged
    (truncated, a flipped byte, an old headerless file): a damaged file is deleted, so the caller compiles again
    and rewrites it; the driver never sees it."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    n = _CACHE_HEADER.size
    if len(data) >= n:
        magic, length, digest = _CACHE_HEADER.unpack_from(data)
        cubin = data[n:]
        if magic == CACHE_MAGIC and length == len(cubin) and hashlib.sha256(cubin).digest() == digest \
                and cubin[:4] == b"\x7fELF":
            return cubin
    try:
        os.unlink(path)
    except OSError:
        pass
    return None


def write_cache_file(path: str, cubin: bytes) -> bool:
    """Store ``cubin`` at ``path`` (header + CUBIN) through a new, uniquely named temporary (``O_EXCL``: never an
    existing file or a planted link) and an atomic rename: readers never see a partial file. Returns False where
    the cache cannot be written (the caller goes on without it)."""
    tmp = f"{path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    created = False
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        created = True
        with os.fdopen(fd, "wb") as f:
            f.write(_CACHE_HEADER.pack(CACHE_MAGIC, len(cubin), hashlib.sha256(cubin).digest()))
            f.write(cubin)
        os.replace(tmp, path)
        return True
    except OSError:
        if created:  # only our own temporary: a file found at its name is not ours to delete
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def _pdl_config() -> tuple[_LaunchAttribute, _LaunchConfig]:
    """A ``cuLaunchKernelEx`` config with the programmatic-serialization attribute (its attribute returned too: the
    config points at it, so the caller keeps both); 1-D blocks; grid, block x, shared bytes and stream unset."""
    attr = _LaunchAttribute()
    attr.id = _PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value[0] = 1
    cfg = _LaunchConfig()
    cfg.attrs = ctypes.pointer(attr)
    cfg.numAttrs = 1
    cfg.blockDimY = cfg.blockDimZ = 1
    return attr, cfg


# Programmatic dependent launch for the kernels that allow it (``pdl=True`` at launch) on devices of compute
# capability >= 9.0: the kernel may start while the previous kernel of the stream finishes; its code waits
# (``griddepcontrol.wait``) before it reads what that kernel wrote. ``options.override(pdl=False)`` turns it off
# (benchmarks compare both).
def pdl_enabled(device) -> bool:
    """Whether a launch with ``pdl=True`` on ``device`` uses programmatic dependent launch now."""
    return options.get().pdl and _cc_major(torch.device(device).index or 0) >= 9


@functools.cache
def _smem_optin(index: int) -> int:
    """Shared bytes a CTA may use on device ``index`` (static + dynamic, with the opt-in attribute)."""
    dev, v = ctypes.c_int(), ctypes.c_int()
    _check_cu(_libcuda().cuDeviceGet(ctypes.byref(dev), index), "device")
    # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
    _check_cu(_libcuda().cuDeviceGetAttribute(ctypes.byref(v), 97, dev), "device attribute")
    return v.value


@functools.cache
def _cc_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


class Kernel:
    """A loaded kernel: ``k(grid, block, fmt, *args)`` launches on the current stream of its device.

    ``fmt`` is the ``struct`` format of the argument buffer (native alignment, ``@`` rules), e.g. ``"QQii"``;
    pass tensor pointers as ints (``t.data_ptr()``).
    """

    def __init__(self, module, func, device, cubin, name):
        self.module, self.func, self.device, self.cubin, self.name = module, func, device, cubin, name
        self._occ = {}
        self._pdl_ok = _cc_major(device.index or 0) >= 9
        self._attr, self._cfg = _pdl_config()
        self._cfg_lock = threading.Lock()
        self._max_shared = -1  # set the attribute on first use: static + dynamic may pass 48 KB below it
        attr = ctypes.c_int()
        _libcuda().cuFuncGetAttribute(ctypes.byref(attr), 4, func)  # CU_FUNC_ATTRIBUTE_NUM_REGS
        self.num_regs = attr.value
        _libcuda().cuFuncGetAttribute(ctypes.byref(attr), 1, func)  # SHARED_SIZE_BYTES
        self.shared_bytes = attr.value

    def occupancy(self, block: int, shared: int = 0) -> int:
        """CTAs of ``block`` threads (``shared`` dynamic bytes) that fit on one SM (driver calculator); 0 where the
        build's static shared memory and ``shared`` together pass what a CTA may use on the device, so that the
        launch would fail (a plan then refuses the build instead of raising from the driver)."""
        n = self._occ.get((block, shared))
        if n is None and self.shared_bytes + shared > _smem_optin(self.device.index or 0):
            n = self._occ[(block, shared)] = 0
        if n is None:
            self.set_shared(shared)
            c = ctypes.c_int()
            _check_cu(_libcuda().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(c), self.func, block,
                                                                               ctypes.c_size_t(shared)), "occupancy")
            n = self._occ[(block, shared)] = max(1, c.value)
        return n

    def set_shared(self, shared: int) -> None:
        """Allow ``shared`` bytes of dynamic shared memory (static + dynamic above 48 KB needs it)."""
        if shared > self._max_shared:
            # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8 (needed when static + dynamic > 48 KB)
            _check_cu(_libcuda().cuFuncSetAttribute(self.func, 8, shared), "set shared memory")
            self._max_shared = shared

    def __call__(self, grid, block, fmt: str, *args, shared: int = 0, pdl: bool = False):
        """Launch; ``pdl=True`` asks for programmatic dependent launch (see :func:`pdl_enabled`): only for
        kernels that call ``pdl_wait()`` before they read anything an earlier kernel may still be writing."""
        if shared > self._max_shared:
            self.set_shared(shared)
        buf = struct.pack("@" + fmt, *args)
        size = ctypes.c_size_t(len(buf))
        cbuf = ctypes.create_string_buffer(buf, len(buf))
        # CU_LAUNCH_PARAM_BUFFER_POINTER = 1, CU_LAUNCH_PARAM_BUFFER_SIZE = 2, CU_LAUNCH_PARAM_END = 0
        extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(cbuf), 2, ctypes.addressof(size), 0)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        if pdl and self._pdl_ok and options.get().pdl:
            with self._cfg_lock:  # one config struct a kernel, filled per launch
                cfg = self._cfg
                cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = gx, gy, gz
                cfg.blockDimX, cfg.sharedMemBytes, cfg.hStream = block, shared, stream
                res = _libcuda().cuLaunchKernelEx(ctypes.byref(cfg), self.func, None, extra)
            _check_cu(res, f"launch {self.name}")
            return
        _check_cu(_libcuda().cuLaunchKernel(self.func, gx, gy, gz, block, 1, 1, shared, ctypes.c_void_p(stream),
                                            None, extra), f"launch {self.name}")


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def arg_offsets(fmt: str, indices) -> tuple:
    """Byte offsets of the arguments ``indices`` (each a 64-bit 'Q') in a ``struct`` buffer of format ``fmt``
    (native alignment, as ``Kernel.__call__`` packs it)."""
    fmt = fmt if fmt.startswith("@") else "@" + fmt
    if any(not 0 <= i < len(fmt) - 1 or fmt[i + 1] != "Q" for i in indices):
        raise ValueError(f"indices: 64-bit pointer arguments ('Q') of {fmt!r} expected, got {tuple(indices)}")
    return tuple(struct.calcsize(fmt[:i + 2]) - 8 for i in indices)


class Prepared:
    """One launch of ``kernel`` with its argument buffer packed once (``fmt``, ``args`` as for ``Kernel.__call__``);
    ``launch(*ptrs)`` writes the 64-bit arguments at indices ``dynamic`` (e.g. the x and y pointers) and launches
    on the current stream: the host cost of a call is a few struct writes and the driver call. The driver copies
    the argument buffer at launch (graph capture included), so the buffer is reused."""

    def __init__(self, kernel: Kernel, grid, block: int, fmt: str, args, dynamic, shared: int = 0,
                 pdl: bool = False):
        kernel.set_shared(shared)
        fmt = "@" + fmt
        self.kernel, self.device = kernel, kernel.device
        self._offs = arg_offsets(fmt, dynamic)
        self._buf = bytearray(struct.pack(fmt, *args))
        self._cbuf = (ctypes.c_char * len(self._buf)).from_buffer(self._buf)
        self._size = ctypes.c_size_t(len(self._buf))
        self._extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(self._cbuf), 2, ctypes.addressof(self._size), 0)
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        self._grid, self._block, self._shared = (gx, gy, gz), block, shared
        self._pdl = pdl and kernel._pdl_ok
        self._attr, self._cfg = _pdl_config()
        self._cfg.gridDimX, self._cfg.gridDimY, self._cfg.gridDimZ = gx, gy, gz
        self._cfg.blockDimX, self._cfg.sharedMemBytes = block, shared
        lib = _libcuda()
        self._launch_ex, self._launch = lib.cuLaunchKernelEx, lib.cuLaunchKernel
        self._lock = threading.Lock()
        self._index = self.device.index or 0

    def launch(self, *ptrs) -> None:
        stream = _RAW_STREAM(self._index) if _RAW_STREAM is not None else \
            torch.cuda.current_stream(self.device).cuda_stream
        with self._lock:  # one buffer: a launch at a time
            for off, p in zip(self._offs, ptrs, strict=True):
                struct.pack_into("@Q", self._buf, off, p)
            if self._pdl and options.get().pdl:
                self._cfg.hStream = stream
                res = self._launch_ex(ctypes.byref(self._cfg), self.kernel.func, None, self._extra)
            else:
                gx, gy, gz = self._grid
                res = self._launch(self.kernel.func, gx, gy, gz, self._block, 1, 1, self._shared,
                                   ctypes.c_void_p(stream), None, self._extra)
        if res != 0:
            _check_cu(res, f"launch {self.kernel.name}")


def load_module(cubin: bytes, device: torch.device, rebuild=None):
    """Load ``cubin`` on ``device`` (an index set); returns (module handle, the CUBIN loaded). ``rebuild()``, if
    given, returns a fresh CUBIN to try where the driver refuses this one (e.g. one from the disk cache)."""
    with torch.cuda.device(device):
        torch.cuda.current_stream()  # make sure the primary context exists and is current
        lib = _libcuda()
        mod = ctypes.c_void_p()
        res = lib.cuModuleLoadData(ctypes.byref(mod), cubin)
        if res != 0 and rebuild is not None:
            cubin = rebuild()
            res = lib.cuModuleLoadData(ctypes.byref(mod), cubin)
        _check_cu(res, "module load")
    return mod, cubin


def get_kernel(module, cubin: bytes, name: str, device: torch.device) -> Kernel:
    """The :class:`Kernel` of ``extern "C"`` function ``name`` of a module :func:`load_module` loaded."""
    func = ctypes.c_void_p()
    _check_cu(_libcuda().cuModuleGetFunction(ctypes.byref(func), module, name.encode()), f"get function {name}")
    return Kernel(module, func, device, cubin, name)


def device_arch(device: torch.device, arch_specific: bool = False) -> str:
    """``sm_XY`` of ``device``; ``arch_specific``: ``sm_XYa`` (features of that GPU only, e.g. wgmma)."""
    return _arch(device) + ("a" if arch_specific else "")
