"""The kbit kernels the harness times ("candidates"), by name.

A candidate is a factory, called once per weight copy, that returns the call to time::

    from kbit.bench.registry import Unsupported, register

    @register("gemv-splitk", note="split-K GEMV, M <= 8")
    def _gemv_splitk(qw, M):                  # qw: one copy of a KbitWeight [N, K]; M: activation rows
        if M > 8:
            raise Unsupported("M > 8")          # the case is skipped, with this reason in the results
        packed = repack(qw)                     # per-copy preparation happens here, outside the timing
        return lambda x: my_gemv(x, packed)     # x: [M, K] bfloat16 -> [M, N]

The built-in candidates live in :mod:`kbit.bench.candidates`, which registers them on import; this module
holds only the registry, so a candidate module may import it without importing the driver.

MoE candidates (``kind="moe"``) get ``(qw, routing)``: ``qw`` a KbitWeight [E, N, K], ``routing`` a
:class:`kbit.bench.moe.Routing`, and return ``lambda a: ...`` mapping the expert-sorted rows ``a``
[P, K] to [P, N] (row ``p`` multiplied by expert ``routing.expert_ids[p]``).

The harness checks each candidate's first output against ``x @ dequantize(qw).T`` (relative Frobenius
error, in the row's ``err``), times it (``kbit.bench.timing``), and counts the bytes of the canonical
format (``kbit.bench.weights.kbit_bytes``). Candidates registered with ``default=False`` run only when named
(``kbit bench --candidates NAME``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kbit.utils.checks import check_choice


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
    check_choice("kind", kind, ("dense", "moe"))

    def deco(factory: Callable) -> Callable:
        if name in CANDIDATES:
            raise ValueError(f"candidate {name!r} is already registered")
        CANDIDATES[name] = Candidate(name, kind, factory, note, default, needs_kbit)
        return factory
    return deco


def select_candidates(kind: str, names: str | None = None) -> list[Candidate]:
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
