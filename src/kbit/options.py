"""kbit's switches: the environment read once into a frozen :class:`Options`, overridable in code.

Every environment variable kbit reads is read here and nowhere else:

==========================  ==================================================================================
``KBIT_CACHE_DIR``          folder of the on-disk CUBIN cache; ``0`` or empty turns the cache off (default:
                            ``$XDG_CACHE_HOME/kbit/cubin``, else ``~/.cache/kbit/cubin``)
``KBIT_NVRTC_LIB``          path of the NVRTC shared library (default: the one torch loads)
``KBIT_NO_CUDA_KERNELS``    ``1``: never use the NVRTC-compiled CUDA kernels (Triton and torch only)
``KBIT_DETERMINISTIC``      ``1``: the small-M kernels 1 and 3 add split-K parts in a fixed order (bit-identical
                            runs); also on while ``torch.use_deterministic_algorithms(True)``. Kernel 7 (sm_90,
                            M > 16) still adds its stream-K parts with fp32 atomics
``KBIT_BACKEND``            force the backend of every k-bit op: ``auto`` (default), ``cuda``, ``triton``,
                            ``torch`` (the plain-torch reference path)
``TRITON_INTERPRET``        Triton's own switch; ``1`` (Triton kernels run on the CPU) also keeps kbit off its
                            CUDA kernels
``XDG_CACHE_HOME``          base folder of the default cache
==========================  ==================================================================================

Code reads the current values with :func:`get` and changes them with :func:`override` (a context manager, for
tests and experiments) or :func:`set_options` (for the rest of the process)::

    with kbit.options.override(pdl=False):
        ...
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["BACKENDS", "Options", "from_environment", "get", "override", "reload", "set_options"]

#: values of :attr:`Options.backend`
BACKENDS = ("auto", "cuda", "triton", "torch")


@dataclass(frozen=True)
class Options:
    """kbit's process-wide settings (see the module docstring for the environment variables behind them)."""

    #: folder of the on-disk CUBIN cache, or None (off)
    cache_dir: str | None = None
    #: path of the NVRTC library to load, or None (the one torch loads)
    nvrtc_lib: str | None = None
    #: whether the NVRTC-compiled CUDA kernels may be used
    cuda_kernels: bool = True
    #: fixed-order split-K reductions in kernels 1 and 3 even without ``torch.use_deterministic_algorithms``
    deterministic: bool = False
    #: one of :data:`BACKENDS`: ``auto`` lets kbit's dispatcher choose
    backend: str = "auto"
    #: Triton runs in its interpreter (no GPU code): set from ``TRITON_INTERPRET``
    interpret: bool = False
    #: programmatic dependent launch (sm_90 and up) for the kernels that support it; no environment variable:
    #: benchmarks compare both through :func:`override`
    pdl: bool = True

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {self.backend!r}")
        for name in ("cuda_kernels", "deterministic", "interpret", "pdl"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected a bool, got {type(getattr(self, name)).__name__}")
        for name in ("cache_dir", "nvrtc_lib"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise TypeError(f"{name}: expected a str or None, got {type(v).__name__}")


def _flag(env, name: str) -> bool:
    v = env.get(name, "0").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"environment variable {name}: expected 0 or 1, got {v!r}")


def from_environment(env=None) -> Options:
    """The :class:`Options` that the environment ``env`` (default ``os.environ``) describes."""
    env = os.environ if env is None else env
    cache = env.get("KBIT_CACHE_DIR")
    if cache is None:
        base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache = os.path.join(base, "kbit", "cubin")
    elif cache in ("", "0"):
        cache = None
    backend = env.get("KBIT_BACKEND", "auto").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"environment variable KBIT_BACKEND: expected one of {BACKENDS}, got {backend!r}")
    return Options(cache_dir=cache, nvrtc_lib=env.get("KBIT_NVRTC_LIB") or None,
                   cuda_kernels=not _flag(env, "KBIT_NO_CUDA_KERNELS"),
                   deterministic=_flag(env, "KBIT_DETERMINISTIC"), backend=backend,
                   interpret=_flag(env, "TRITON_INTERPRET"))


_LOCK = threading.Lock()
_CURRENT: list[Options | None] = [None]


def get() -> Options:
    """The options in force (the environment is read on the first call)."""
    cur = _CURRENT[0]
    if cur is None:
        with _LOCK:
            cur = _CURRENT[0]
            if cur is None:
                cur = _CURRENT[0] = from_environment()
    return cur


def set_options(**changes) -> Options:
    """Change options for the rest of the process (fields of :class:`Options`); returns the previous options."""
    with _LOCK:
        prev = _CURRENT[0] if _CURRENT[0] is not None else from_environment()
        _CURRENT[0] = _replace(prev, changes)
    return prev


def reload() -> Options:
    """Read the environment again (for tests that change it); returns the new options."""
    with _LOCK:
        _CURRENT[0] = from_environment()
        return _CURRENT[0]


@contextlib.contextmanager
def override(**changes) -> Iterator[Options]:
    """Within the ``with`` block the options have ``changes`` (fields of :class:`Options`); restored after."""
    prev = set_options(**changes)
    try:
        yield get()
    finally:
        with _LOCK:
            _CURRENT[0] = prev


def _replace(opts: Options, changes: dict) -> Options:
    fields = {f.name for f in dataclasses.fields(Options)}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise TypeError(f"options: unknown field(s) {unknown}; expected some of {sorted(fields)}")
    return dataclasses.replace(opts, **changes)
