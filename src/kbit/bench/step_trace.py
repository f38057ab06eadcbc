"""The pure-Python half of the decode-step profile (issue 36): a profiler trace in, one row per kernel out.

A trace is the Chrome-trace JSON that ``torch.profiler`` exports (``traceEvents``: kernels, memcpys and memsets on
the GPU; on the CPU the ``record_function`` ranges and the runtime / driver calls that launched each kernel, tied
to their kernel by ``args.correlation``). :mod:`kbit.bench.step_profile` opens one range per module call and glue
op of an eager step, named ``PREFIX + "<id>:<label>"``, and keeps a :class:`Range` per id: what it is (its kind)
and the bytes it must read (weights, touched experts, the KV cache at the context).

Here: each kernel of the eager step gets the innermost range that was open when it was launched
(:func:`attribute`); the kernels of a CUDA-graph replay of the same step get those ranges by their order
(:func:`transfer`: the graph holds the same launches); a range's bytes go to its own kernels in proportion to
their time (to its sub-ranges' kernels when it has none); the gap before a kernel is its start minus the latest
end before it (negative: it overlapped its predecessor, e.g. under programmatic dependent launch). The report and
the plot are in :mod:`kbit.bench.step_report`.
"""
from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field

from kbit.utils.checks import check_choice, fail

__all__ = ["GPU_CATS", "KINDS", "NO_RANGE", "PREFIX", "Kernel", "KernelRow", "Range", "StepProfile", "attribute",
           "build_profile", "drop_far", "gaps_before", "gpu_kernels", "kernel_bytes", "parse_range_name", "range_name",
           "role", "split_run", "subtree", "trace_events", "transfer"]

#: what a kernel serves, in report order
KINDS = ("k-bit GEMV", "bf16 GEMV", "MoE routing", "attention", "norm/glue", "lm_head", "sampling", "other")
#: the prefix of the record_function names of :mod:`kbit.bench.step_profile` (others in a trace are ignored)
PREFIX = "kbit.step:"
#: the label of kernels launched outside every range
NO_RANGE = "(no range)"
#: trace categories of work on the GPU
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
#: trace categories of the host calls that launch it
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


@dataclass
class Range:
    """One module call or glue op of the profiled step. Filled while the step runs (the bytes of touched experts
    only after it), so not frozen. ``parent``: the id of the range it was opened in (None at the top)."""

    id: int
    label: str
    kind: str
    nbytes: int = 0
    parent: int | None = None

    def __post_init__(self):
        check_choice("kind", self.kind, KINDS)


@dataclass(frozen=True)
class Kernel:
    """One piece of GPU work: ``start_us`` on the trace's clock, ``range_id`` the range it serves (None: none)."""

    name: str
    start_us: float
    dur_us: float
    range_id: int | None = None

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


def range_name(range_id: int, label: str) -> str:
    """The record_function name of range ``range_id``."""
    return f"{PREFIX}{range_id}:{label}"


def parse_range_name(name: str) -> int | None:
    """The range id in a record_function name made by :func:`range_name`, None for any other name."""
    if not name.startswith(PREFIX):
        return None
    head = name[len(PREFIX):].split(":", 1)[0]
    return int(head) if head.isdigit() else None


def trace_events(trace) -> list[dict]:
    """The complete (``ph == "X"``) events of a Chrome trace: the exported dict or its ``traceEvents`` list."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        fail(TypeError, "trace", "a dict with a 'traceEvents' list or a list of events", type(trace).__name__)
    return [e for e in events if isinstance(e, dict) and e.get("ph", "X") == "X" and "ts" in e]


def gpu_kernels(events: list[dict]) -> list[Kernel]:
    """The kernels, memcpys and memsets of a trace in start order (no range)."""
    out = [Kernel(str(e.get("name", "?")), float(e["ts"]), float(e.get("dur", 0.0)))
           for e in events if e.get("cat") in GPU_CATS]
    return sorted(out, key=lambda k: (k.start_us, k.end_us))


class _Intervals:
    """Ranges of one thread, sorted by start: the innermost one open at a time (ranges nest)."""

    def __init__(self):
        self.items: list[tuple[float, float, int]] = []

    def innermost(self, t: float) -> int | None:
        # nested ranges: scanning back from the last one started at or before t, the first that still holds t is
        # the innermost (the ones in between ended earlier)
        lo, hi = 0, len(self.items)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.items[mid][0] <= t:
                lo = mid + 1
            else:
                hi = mid
        for start, end, rid in reversed(self.items[:lo]):
            if start <= t <= end:
                return rid
        return None


def _ranges_by_thread(events: list[dict], cat: str) -> dict:
    threads: dict = {}
    for e in events:
        rid = parse_range_name(str(e.get("name", ""))) if e.get("cat") == cat else None
        if rid is not None:
            start = float(e["ts"])
            threads.setdefault((e.get("pid"), e.get("tid")), _Intervals()).items.append(
                (start, start + float(e.get("dur", 0.0)), rid))
    for iv in threads.values():
        iv.items.sort(key=lambda x: (x[0], -x[1]))
    return threads


def _innermost_any(cpu: dict, where: tuple, t: float) -> int | None:
    """The innermost range at ``t`` on thread ``where``, else on any thread (a launch recorded under another id)."""
    own = cpu.get(where)
    rid = own.innermost(t) if own is not None else None
    for iv in cpu.values():
        if rid is not None:
            break
        if iv is not own:
            rid = iv.innermost(t)
    return rid


def attribute(events: list[dict]) -> list[Kernel]:
    """The GPU work of a profiler run, each piece with the innermost range open when it was launched: found
    through its launch call (``args.correlation`` of a runtime / driver event), else through the CPU op it was
    launched in (``args["External id"]``), else the innermost GPU-side range (``gpu_user_annotation``) holding its
    start; None when none holds. In start order."""
    cpu = _ranges_by_thread(events, "user_annotation")
    gpu = _ranges_by_thread(events, "gpu_user_annotation")
    launches, ops = {}, {}
    for e in events:
        args = e.get("args") or {}
        if e.get("cat") in LAUNCH_CATS and args.get("correlation") is not None:
            launches[args["correlation"]] = e
        elif e.get("cat") in ("cpu_op", "user_annotation") and args.get("External id") is not None:
            ops[args["External id"]] = e
    out = []
    for e in events:
        if e.get("cat") not in GPU_CATS:
            continue
        args, start, rid = e.get("args") or {}, float(e["ts"]), None
        launch = launches.get(args.get("correlation"))
        if launch is not None:
            rid = _innermost_any(cpu, (launch.get("pid"), launch.get("tid")), float(launch["ts"]))
        op = ops.get(args.get("External id")) if rid is None else None
        if op is not None:
            rid = parse_range_name(str(op.get("name", "")))
            if rid is None:
                rid = _innermost_any(cpu, (op.get("pid"), op.get("tid")), float(op["ts"]))
        for iv in gpu.values():
            if rid is not None:
                break
            rid = iv.innermost(start)
        out.append(Kernel(str(e.get("name", "?")), start, float(e.get("dur", 0.0)), rid))
    return sorted(out, key=lambda k: (k.start_us, k.end_us))


def transfer(eager: list[Kernel], timed: list[Kernel]) -> tuple[list[Kernel], int]:
    """``timed`` (a graph replay of the step: real gaps, no ranges) with the ranges of ``eager`` (the same launches,
    attributed), matched in order by kernel name; returns the kernels and how many were matched (the others get no
    range)."""
    sm = difflib.SequenceMatcher(None, [k.name for k in eager], [k.name for k in timed], autojunk=False)
    rids: list[int | None] = [None] * len(timed)
    matched = 0
    for block in sm.get_matching_blocks():
        for i in range(block.size):
            rids[block.b + i] = eager[block.a + i].range_id
        matched += block.size
    return [Kernel(k.name, k.start_us, k.dur_us, r) for k, r in zip(timed, rids, strict=True)], matched


def gaps_before(kernels: list[Kernel]) -> list[float]:
    """Per kernel (in start order), its start minus the latest end of the kernels before it, in us; 0 for the first.
    Negative: it started before its predecessors finished (overlap)."""
    out, last_end = [], None
    for k in kernels:
        out.append(0.0 if last_end is None else k.start_us - last_end)
        last_end = k.end_us if last_end is None else max(last_end, k.end_us)
    return out


def _descendants(ranges: dict[int, Range]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for r in ranges.values():
        if r.parent is not None:
            children.setdefault(r.parent, []).append(r.id)
    out = {}
    for rid in ranges:
        todo, seen = list(children.get(rid, [])), []
        while todo:
            c = todo.pop()
            seen.append(c)
            todo.extend(children.get(c, []))
        out[rid] = seen
    return out


def subtree(ranges: dict[int, Range], root: int) -> list[int]:
    """``root`` and every range opened inside it, at any depth."""
    return [root, *_descendants(ranges).get(root, [])]


def split_run(kernels: list[Kernel], ranges: dict[int, Range], step_id: int,
                  replay_id: int | None = None) -> tuple[list[Kernel], list[Kernel] | None]:
    """The kernels of one profiler run: (those of range ``step_id`` and its sub-ranges, those of a graph replay
    launched in range ``replay_id``). Graph kernels share the correlation of their graph launch; where the trace
    ties them to no launch, they have no range, and the replay's kernels are those without one (None: no replay)."""
    keep = set(subtree(ranges, step_id))
    eager = [k for k in kernels if k.range_id in keep]
    if replay_id is None:
        return eager, None
    return eager, [k for k in kernels if k.range_id == replay_id] or [k for k in kernels if k.range_id is None]


def drop_far(kernels: list[Kernel], window_us: float = 1e7) -> list[Kernel]:
    """``kernels`` without those starting more than ``window_us`` from their median start: a record with a broken
    timestamp (CUPTI can hand back a run's first records on another clock, ~1e14 ns off) would stretch the
    step's span by days."""
    if not kernels:
        return []
    starts = sorted(k.start_us for k in kernels)
    mid = starts[len(starts) // 2]
    return [k for k in kernels if abs(k.start_us - mid) <= window_us]


def kernel_bytes(kernels: list[Kernel], ranges: dict[int, Range]) -> tuple[list[float], int]:
    """The bytes each kernel must read: a range's bytes split over its own kernels in proportion to their time
    (equally when all take 0), or over its sub-ranges' kernels when it has none. Returns the per-kernel bytes and
    the bytes of ranges with no kernel at all."""
    by_range: dict[int, list[int]] = {}
    for i, k in enumerate(kernels):
        if k.range_id is not None:
            by_range.setdefault(k.range_id, []).append(i)
    desc = _descendants(ranges)
    out, lost = [0.0] * len(kernels), 0
    for rid, r in ranges.items():
        if r.nbytes <= 0:
            continue
        idx = by_range.get(rid) or [i for d in desc[rid] for i in by_range.get(d, [])]
        if not idx:
            lost += r.nbytes
            continue
        total = sum(kernels[i].dur_us for i in idx)
        for i in idx:
            out[i] += r.nbytes * (kernels[i].dur_us / total if total > 0 else 1.0 / len(idx))
    return out, lost


def role(label: str) -> str:
    """A label with its layer index replaced by ``*``: every layer's same module in one row."""
    return re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", label)


@dataclass(frozen=True)
class KernelRow:
    """One kernel of the profiled step. Times in us (start from the first kernel), ``gap_us`` the idle time before
    it (negative: overlap), ``nbytes`` its share of the bytes of the module call it serves (``label``)."""

    index: int
    name: str
    label: str
    kind: str
    start_us: float
    dur_us: float
    gap_us: float
    nbytes: float


@dataclass(frozen=True)
class StepProfile:
    """One decode step, kernel by kernel, with its totals.

    rows: every kernel in start order. span_us: first start to last end. kernel_us: sum of kernel times.
    gap_us: sum of the positive gaps; overlap_us: minus the sum of the negative ones. nbytes: the bytes the step
    must read (sum over its ranges, ``unassigned_bytes`` of them in ranges that launched nothing).
    ceiling_tbps: the read ceiling the roofline uses; step_ms: the step time the roofline is compared with (the
    unprofiled graph replay where given, else the span). meta: what was profiled and how (free-form).
    """

    rows: tuple[KernelRow, ...]
    span_us: float
    kernel_us: float
    gap_us: float
    overlap_us: float
    nbytes: float
    unassigned_bytes: float
    ceiling_tbps: float
    step_ms: float
    meta: dict = field(default_factory=dict)

    @property
    def roofline_ms(self) -> float:
        """The step's bytes at the read ceiling."""
        return self.nbytes / (self.ceiling_tbps * 1e12) * 1e3 if self.ceiling_tbps > 0 else float("nan")

    @property
    def pct_roofline(self) -> float:
        """The roofline as a percentage of the step time."""
        return 100.0 * self.roofline_ms / self.step_ms if self.step_ms > 0 else float("nan")


def build_profile(kernels: list[Kernel], ranges: dict[int, Range], *, ceiling_tbps: float,
                  step_ms: float | None = None, meta: dict | None = None) -> StepProfile:
    """The :class:`StepProfile` of ``kernels`` (one step, any order) served by ``ranges``. Kernels without a range
    are of kind "other"."""
    if not ceiling_tbps > 0:
        fail(ValueError, "ceiling_tbps", "> 0", ceiling_tbps)
    kernels = sorted(kernels, key=lambda k: (k.start_us, k.end_us))
    gaps = gaps_before(kernels)
    shares, lost = kernel_bytes(kernels, ranges)
    t0 = kernels[0].start_us if kernels else 0.0
    rows = []
    for i, (k, g, b) in enumerate(zip(kernels, gaps, shares, strict=True)):
        r = ranges.get(k.range_id) if k.range_id is not None else None
        rows.append(KernelRow(i, k.name, r.label if r else NO_RANGE, r.kind if r else "other",
                              k.start_us - t0, k.dur_us, g, b))
    span = (max(k.end_us for k in kernels) - t0) if kernels else 0.0
    return StepProfile(
        rows=tuple(rows), span_us=span, kernel_us=sum(k.dur_us for k in kernels),
        gap_us=sum(g for g in gaps if g > 0), overlap_us=-sum(g for g in gaps if g < 0),
        nbytes=float(sum(r.nbytes for r in ranges.values())), unassigned_bytes=float(lost),
        ceiling_tbps=float(ceiling_tbps), step_ms=float(step_ms) if step_ms else span / 1e3, meta=dict(meta or {}))
