"""The kbit kernels the harness times ("candidates"), by name.

A candidate is a factory, called once per weight copy, that returns the call to time::

    from kbit.bench.registry import Unsupported, register

    @register("gemv-splitk", note="split-K GEMV, M <= 8")
    def _gemv_splitk(qw, M):                  # qw: one copy of a KbitWeight [N, K]; M: activation rows
        if M > 8:
            raise Unsupported("M > 8")          # the case is skipped, with this reason in the results
        packed = repack(qw)                     # per-copy preparation happens here, outside the timing
        return lambda x: my_gemv(x, packed)     # x: [M, K] bfloat16 -> [M, N]

MoE candidates (``kind="moe"``) get ``(qw, routing)``: ``qw`` a KbitWeight [E, N, K], ``routing`` a
:class:`kbit.bench.moe.Routing`, and return ``lambda a: ...`` mapping the expert-sorted rows ``a``
[P, K] to [P, N] (row ``p`` multiplied by expert ``routing.expert_ids[p]``).

The harness checks each candidate's first output against ``x @ dequantize(qw).T`` (relative Frobenius
error, in the row's ``err``), times it (``kbit.bench.timing``), and counts the bytes of the canonical
format (``kbit.bench.run.kbit_bytes``). Candidates registered with ``default=False`` run only when named
(``kbit bench --candidates NAME``). Everything kbit is imported when a factory runs, not when this module
is imported, so the harness works before (and whatever part of) the library has landed.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class Unsupported(Exception):
    """Raised by a factory for a case it does not handle (a k, M, blocksize...); the message is the reason."""


@dataclass(frozen=True)
class Candidate:
    """name: as in results; kind: "dense" or "moe"; factory: see the module docstring; note: one line for
    the report; default: timed when no --candidates are named; needs_kbit: False only for harness checks
    that run on a stand-in weight when ``kbit.quantize`` is missing."""

    name: str
    kind: str
    factory: Callable
    note: str = ""
    default: bool = True
    needs_kbit: bool = True


CANDIDATES: dict[str, Candidate] = {}


def register(name: str, *, kind: str = "dense", note: str = "", default: bool = True,
             needs_kbit: bool = True) -> Callable[[Callable], Callable]:
    """Decorator adding a factory to CANDIDATES under ``name`` (a name registered twice is an error)."""
    if kind not in ("dense", "moe"):
        raise ValueError(f"kind must be 'dense' or 'moe', got {kind!r}")

    def deco(factory: Callable) -> Callable:
        if name in CANDIDATES:
            raise ValueError(f"candidate {name!r} is already registered")
        CANDIDATES[name] = Candidate(name, kind, factory, note, default, needs_kbit)
        return factory
    return deco


def select(kind: str, names: str | None = None) -> list[Candidate]:
    """Candidates of ``kind``: those named in the comma list ``names`` ("all": every one; None: defaults)."""
    pool = [c for c in CANDIDATES.values() if c.kind == kind]
    if names is None:
        return [c for c in pool if c.default]
    if names.strip() == "all":
        return pool
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in CANDIDATES]
    if unknown:
        raise ValueError(f"unknown candidates {unknown}; registered: {sorted(CANDIDATES)}")
    return [c for c in pool if c.name in wanted]


# ------------------------------------------------------------------------------------------ built-ins
def _gemv_kwargs(qw) -> dict:
    N, K = qw.shape[-2], qw.shape[-1]
    return dict(k=qw.k, blocksize=qw.blocksize, scale_format=qw.scale_format, N=N, K=K)


@register("gemv", note="kbit.ops.gemv.gemv (the fused GEMV)")
def _gemv(qw, M):
    try:
        from kbit.ops.gemv import gemv
    except ImportError as e:
        raise Unsupported(f"kbit.ops.gemv not importable ({e})") from e
    kw = _gemv_kwargs(qw)
    return lambda x: gemv(x, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw)


@register("dequant+bf16", note="kbit.dequantize then F.linear (unfused baseline)", default=False)
def _dequant_linear(qw, M):
    from kbit.bench.run import kbit_api
    api = kbit_api()
    if api is None:
        raise Unsupported("kbit.dequantize not available")
    dequantize = api[1]
    return lambda x: F.linear(x, dequantize(qw, dtype=torch.bfloat16))


@register("dummy-linear", note="F.linear on a bf16 weight of the same shape (harness self-check)",
          default=False, needs_kbit=False)
def _dummy_linear(qw, M):
    N, K = qw.shape[-2], qw.shape[-1]
    w = torch.randn(N, K, device=qw.codes.device, dtype=torch.bfloat16) * 0.02
    return lambda x: F.linear(x, w)


@register("grouped_gemv", kind="moe", note="kbit.ops.gemv.grouped_gemv")
def _grouped_gemv(qw, routing):
    try:
        from kbit.ops.gemv import grouped_gemv
    except ImportError as e:
        raise Unsupported(f"kbit.ops.gemv.grouped_gemv not importable ({e})") from e
    kw = _gemv_kwargs(qw)
    eids = routing.expert_ids
    # the harness hands over rows already gathered per (token, slot), so row p is "token" p
    rows = torch.arange(eids.numel(), dtype=torch.int32, device=eids.device)
    return lambda a: grouped_gemv(a, rows, eids, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw)


@register("grouped_mma", kind="moe", note="kbit.ops.grouped_mma.grouped_linear (tensor cores, CUDA)")
def _grouped_mma(qw, routing):
    try:
        from kbit.ops.grouped_mma import available, grouped_linear
    except ImportError as e:
        raise Unsupported(f"kbit.ops.grouped_mma not importable ({e})") from e
    eids = routing.expert_ids
    if not available(eids.device):
        raise Unsupported("the CUDA grouped kernel is not available here (NVRTC / GPU)")
    kw = _gemv_kwargs(qw)
    rows = torch.arange(eids.numel(), dtype=torch.int32, device=eids.device)
    return lambda a: grouped_linear(a, rows, eids, qw.codes, qw.scales, qw.tensor_scale, qw.codebook, **kw)


# GEMM candidates (issue 4) register themselves on import; kept in their own module.
from kbit.bench import candidates_gemm as _candidates_gemm  # noqa: E402,F401
