"""The all-reduce of a row-parallel layer's partial products: NCCL, or PyTorch's symmetric-memory one-shot /
two-shot kernels for small messages, chosen by message size from a per-GPU table (:data:`ALLREDUCE_TABLE`).

A decode step sends two all-reduces a block of ``batch x hidden`` bf16 values (8 KB at batch 1, 512 KB at 64 for
hidden 4096). NCCL's ring / tree kernels pay a fixed latency of several microseconds a call there. The
symmetric-memory kernels (``torch.ops.symm_mem``, P2P over NVLink) do it in one launch: each rank writes its
partial product into a buffer that every peer can load from (allocated once per group and dtype with
``torch.distributed._symmetric_memory.empty`` + ``rendezvous``), a barrier through signal pads, then

- one-shot: every rank loads all peers' buffers and sums them (``one_shot_all_reduce_copy_out``: the copy of the
  partial product into the buffer happens inside the same kernel, so it costs no launch of its own);
- two-shot: a reduce-scatter then an all-gather over the buffers (half the loads of one-shot a rank at world 2,
  one more barrier: better for larger messages).

Both end with a barrier, so one buffer serves every layer of the group in stream order. The NVLink multicast
(``multimem``) kernels are never used: multicast is off on the machines these were measured on.

- lamport (bf16 only): no barrier at all: every rank stores its partial product into each peer's buffer and polls
  its own until the data has arrived (the data is its own flag; :mod:`kbit.ops.allreduce`). Less than half the
  one-shot time at decode sizes; its buffer (:class:`kbit.ops.allreduce.LamportBuffer`) is made like the other.

Symmetric memory is used only where it is available (a CUDA tensor, an NCCL group, the ops present in this
torch, P2P between the GPUs); the buffer is made at the first eligible call outside CUDA-graph capture (run one
eager step before capturing, as ``KbitLinear`` needs anyway); otherwise NCCL. Every rank makes the same choice
(it depends on the message size and the software, not on data), so the collectives match.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist

try:  # a private torch module (absent from builds without distributed support): NCCL only then
    import torch.distributed._symmetric_memory as symm_mem
except ImportError:  # pragma: no cover
    symm_mem = None

from kbit.ops.allreduce import LamportBuffer, lamport_all_reduce
from kbit.tuning.tables import gpu_key
from kbit.utils.checks import check_choice, check_int, fail

__all__ = ["ALLREDUCE_TABLE", "METHODS", "AllReduceConfig", "all_reduce_sum", "allreduce_config", "choose_method",
           "symm_mem_missing"]

#: ways to sum a tensor over the group
METHODS = ("nccl", "one_shot", "two_shot", "lamport")

#: the ``torch.ops.symm_mem`` ops a method runs on, the first present of each list (one-shot copies the partial
#: product into the buffer inside its kernel where this torch has ``_copy_out``, else in a copy of its own)
_OPS = {"one_shot": (("one_shot_all_reduce_copy_out", "one_shot_all_reduce_out"),),
        "two_shot": (("two_shot_all_reduce_out",),), "lamport": ()}


@dataclass(frozen=True)
class AllReduceConfig:
    """Which all-reduce serves a message of ``nbytes`` bytes: Lamport up to ``lamport_max_bytes`` (bf16 only), then
    one-shot up to ``one_shot_max_bytes``, then two-shot up to ``two_shot_max_bytes``, else NCCL (0 turns a method
    off). The symmetric buffers hold the largest message each serves, per group (and dtype)."""

    #: bf16 messages of at most this many bytes go through the barrier-free kernel
    lamport_max_bytes: int = 0
    #: messages of at most this many bytes go through the one-shot kernel
    one_shot_max_bytes: int = 0
    #: messages above ``one_shot_max_bytes`` and at most this many bytes go through the two-shot kernel
    two_shot_max_bytes: int = 0

    def __post_init__(self):
        check_int("lamport_max_bytes", self.lamport_max_bytes, minimum=0)
        check_int("one_shot_max_bytes", self.one_shot_max_bytes, minimum=0)
        check_int("two_shot_max_bytes", self.two_shot_max_bytes, minimum=0)

    @property
    def buffer_bytes(self) -> int:
        return max(self.one_shot_max_bytes, self.two_shot_max_bytes)

    def method(self, nbytes: int, dtype: torch.dtype = torch.bfloat16) -> str:
        """The method for a message of ``nbytes`` in ``dtype`` (before availability is checked)."""
        if nbytes <= self.lamport_max_bytes and dtype == torch.bfloat16:
            return "lamport"
        if nbytes <= self.one_shot_max_bytes:
            return "one_shot"
        if nbytes <= self.two_shot_max_bytes:
            return "two_shot"
        return "nccl"


#: (gpu key of ``kbit.tuning.tables.gpu_key``, world size) -> config; other keys use ``("generic", world)``, then
#: NCCL only. Measure a GPU with ``lab/parallel/allreduce_bench.py`` and add its "proposed row".
#: The h200 row is that script's on 2 x H200 (torch 2.11): one-shot the fastest up to 1 MiB, two-shot at 2 MiB;
#: Lamport (lab/parallel/lamport_ar.py) faster than both at every size measured (up to 512 KiB).
#: The h100 row is both scripts' on 2 x H100 (torch 2.11, benchmarks/results/h100x2/tp-decode-2026-11-26.md): Lamport
#: the fastest up to 1 MiB (3.3 us at 8 KiB against NCCL's 10.6); symmetric-memory one-shot within 1.4 us of NCCL
#: either way (two scripts disagree on the sign), so not taken.
#: Two-shot is ahead only at 2 MiB and behind NCCL below it, where it would take float32 messages: left out.
#: The generic bound is lower: PyTorch's note has one-shot beat NCCL below about 400 KB on 8 x H100.
ALLREDUCE_TABLE: dict[tuple[str, int], AllReduceConfig] = {
    ("h200", 2): AllReduceConfig(lamport_max_bytes=512 * 1024, one_shot_max_bytes=1024 * 1024,
                                 two_shot_max_bytes=2048 * 1024),
    ("h100", 2): AllReduceConfig(lamport_max_bytes=1024 * 1024),
    ("generic", 2): AllReduceConfig(one_shot_max_bytes=256 * 1024),
}


@functools.cache
def _cuda_config(index: int, world: int) -> AllReduceConfig:
    key = gpu_key(torch.device("cuda", index))  # cached: the device name is a driver query
    return ALLREDUCE_TABLE.get((key, world)) or ALLREDUCE_TABLE.get(("generic", world)) or AllReduceConfig()


def allreduce_config(device, world: int) -> AllReduceConfig:
    """The table's config for ``world`` ranks on ``device`` (a CPU device: NCCL only)."""
    device = torch.device(device)
    if device.type != "cuda":
        return AllReduceConfig()
    return _cuda_config(device.index if device.index is not None else torch.cuda.current_device(), world)


def symm_mem_missing(method: str) -> list[str]:
    """The ``torch.ops.symm_mem`` ops ``method`` needs that this torch lacks ([] for NCCL)."""
    check_choice("method", method, METHODS)
    return list(_missing(method))


@functools.cache
def _missing(method: str) -> tuple[str, ...]:
    # once a process: which ops torch has does not change, and the choice runs on every eager all-reduce
    ops = getattr(torch.ops, "symm_mem", None) if symm_mem is not None else None
    return tuple(" or ".join(names) for names in _OPS.get(method, ())
                 if ops is None or not any(hasattr(ops, n) for n in names))


def _group_name(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def _eligible(y: torch.Tensor, group, method: str) -> bool:
    """Whether ``method``'s symmetric-memory kernel can sum ``y`` (the same answer on every rank)."""
    dtypes = (torch.bfloat16,) if method == "lamport" else (torch.bfloat16, torch.float32)
    if not y.is_cuda or torch.version.hip is not None or y.dtype not in dtypes or symm_mem is None:
        return False
    if "nccl" not in str(dist.get_backend(group)) or not y.is_contiguous() or y.data_ptr() % 16:
        return False  # the kernels load vectors of the local input and of the buffer at the same alignment
    return (y.numel() * y.element_size()) % 4 == 0  # the kernels move 4, 8 or 16 bytes a thread


#: (group name, device index, dtype) -> symmetric buffer (flat), or None where its rendezvous failed
_BUFFERS: dict[tuple[str, int, torch.dtype], torch.Tensor | None] = {}
#: buffers replaced by larger ones: kept, since a captured CUDA graph may still read them
_RETIRED: list = []


def _grown(cache: dict, key, fits, make):
    """``cache[key]`` where it ``fits``; else a new one from ``make()`` (collective: every rank gets here at once),
    the old one retired; None where symmetric memory failed once (NCCL from then on) or inside a graph capture."""
    old = cache.get(key, False)
    if old is None or (old is not False and fits(old)):
        return old
    if torch.cuda.is_current_stream_capturing():
        return None  # allocation and rendezvous cannot be captured: NCCL in this graph
    if old is not False:
        _RETIRED.append(old)
    try:
        buf = make()
    except (RuntimeError, NotImplementedError, ValueError) as err:
        warnings.warn(f"kbit.parallel: symmetric memory unavailable ({err}); all-reduces use NCCL", stacklevel=4)
        buf = None
    cache[key] = buf
    return buf


def _buffer(group, device: torch.device, dtype: torch.dtype, nbytes: int) -> torch.Tensor | None:
    """The group's symmetric buffer of at least ``nbytes`` (made now, collectively, if it is not yet)."""
    name = _group_name(group)

    def make():
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            with warnings.catch_warnings():  # deprecated (a no-op) in newer torch, required in older
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(name)
        esize = torch.empty((), dtype=dtype).element_size()
        buf = symm_mem.empty(-(-nbytes // esize), dtype=dtype, device=device)
        symm_mem.rendezvous(buf, name)
        return buf

    return _grown(_BUFFERS, (name, device.index, dtype), lambda b: b.numel() * b.element_size() >= nbytes, make)


#: (group name, device index) -> the barrier-free all-reduce's buffer, or None where it could not be made
_LAMPORT: dict[tuple[str, int], LamportBuffer | None] = {}


def _lamport_buffer(group, device: torch.device, numel: int) -> LamportBuffer | None:
    """The group's Lamport buffer for messages of ``numel`` elements (made now, collectively, if it is not yet)."""
    return _grown(_LAMPORT, (_group_name(group), device.index), lambda b: b.capacity >= numel,
                  lambda: LamportBuffer(numel, device, group))


def choose_method(y: torch.Tensor, group=None, config: AllReduceConfig | None = None) -> str:
    """The method :func:`all_reduce_sum` uses for ``y`` over ``group`` (``config``: default the table's)."""
    world = dist.get_world_size(group)
    config = allreduce_config(y.device, world) if config is None else config
    method = config.method(y.numel() * y.element_size(), y.dtype)
    if method == "nccl" or _missing(method) or not _eligible(y, group, method):
        return "nccl"
    return method


def all_reduce_sum(y: torch.Tensor, group=None, config: AllReduceConfig | None = None,
                   method: str | None = None) -> torch.Tensor:
    """The sum of ``y`` over the ranks of ``group``; returns ``y`` itself (NCCL, in place) or a new tensor.

    ``method``: force one of :data:`METHODS` (benchmarks and tests; where it is unavailable, NCCL); default
    :func:`choose_method` by message size from ``config`` (default: :func:`allreduce_config` of ``y``'s device).
    """
    if not isinstance(y, torch.Tensor):
        fail(TypeError, "y", "a torch.Tensor", type(y).__name__)
    if method is None:
        method = choose_method(y, group, config)
    else:
        check_choice("method", method, METHODS)
        if method != "nccl" and (_missing(method) or not _eligible(y, group, method)):
            method = "nccl"
    if method != "nccl" and config is None:
        config = allreduce_config(y.device, dist.get_world_size(group))
    if method == "lamport":
        lamport = _lamport_buffer(group, y.device, max(y.numel(), config.lamport_max_bytes // 2))
        if lamport is not None and lamport.capacity >= y.numel():
            return lamport_all_reduce(y, lamport)
    elif method != "nccl":
        cap = max(y.numel() * y.element_size(), config.buffer_bytes)
        buf = _buffer(group, y.device, y.dtype, cap)
        if buf is not None and buf.numel() >= y.numel():
            return _symm_all_reduce(y, buf[:y.numel()].view_as(y), method, _group_name(group))
    dist.all_reduce(y, group=group)
    return y


def _symm_all_reduce(y: torch.Tensor, view: torch.Tensor, method: str, name: str) -> torch.Tensor:
    out = torch.empty_like(y)
    ops = torch.ops.symm_mem
    if method == "one_shot" and hasattr(ops, "one_shot_all_reduce_copy_out"):
        return ops.one_shot_all_reduce_copy_out(view, y, "sum", name, out)
    view.copy_(y)
    if method == "one_shot":
        return ops.one_shot_all_reduce_out(view, "sum", name, out)
    return ops.two_shot_all_reduce_out(view, "sum", name, out)
