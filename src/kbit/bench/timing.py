"""Cold-L2 timing of GPU calls with CUDA-graph replay.

The method (issue 3, after FlashInfer's ``bench_gpu_time``): a benchmark builds ``n`` independent copies of
the weight it reads, so that all copies together exceed ``8 x L2``; one CUDA graph calls the kernel once
per copy; the graph is replayed ``reps`` (>= 15) times, each replay timed with CUDA events; the result is
the median replay time divided by ``n``. Each call therefore reads its weight from device memory, not from
the L2 filled by the previous call, and launch gaps are those of a graph (as in a decoding step that runs
under a graph). If capture fails, a plain loop of the same calls is timed with events instead
(``mode="loop"``), and the row says so.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

REPS = 15          # replays timed; the issue asks for a median of at least 15
WARMUP = 3         # replays before timing (clocks up, allocator settled)
#: and more replays before timing until about this much GPU time has passed. Right after 8 GB of new device memory
#: were written and freed (as a benchmark does between shapes), an H100 ran the next calls 16-17% slower (3% at
#: 4096x4096); 25 ms of replays removed that, 3 replays, a new capture or an emptied allocator cache did not
#: (lab/clock_warmup.py --settle, benchmarks/results/h100/first-timing-2026-11-27.md)
WARMUP_MS = 50.0
L2_FACTOR = 8      # all copies together exceed L2_FACTOR x the L2
DEFAULT_L2_BYTES = 50 * 1000 * 1000  # H100 SXM; used only when the device does not report its L2


@dataclass(frozen=True)
class Timing:
    """One timed set of calls.

    us: median over replays of (replay time / calls), microseconds per call.
    us_min, us_max: the fastest and slowest replay, per call (the spread of the measurement).
    calls: calls per replay (= weight copies rotated).
    reps: replays timed.
    mode: "graph" (CUDA-graph replay) or "loop" (events around a plain loop; capture failed).
    """

    us: float
    us_min: float
    us_max: float
    calls: int
    reps: int
    mode: str


def l2_bytes(device: torch.device | int | None = None) -> int:
    """The L2 cache size of ``device`` in bytes (DEFAULT_L2_BYTES when unknown or no GPU)."""
    if not torch.cuda.is_available():
        return DEFAULT_L2_BYTES
    props = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def copies_for_cold_l2(bytes_per_copy: int, l2: int, factor: int = L2_FACTOR, min_copies: int = 2,
                       max_copies: int = 4096) -> int:
    """How many copies of ``bytes_per_copy`` bytes together exceed ``factor * l2`` bytes (strictly).

    At least ``min_copies``, so that consecutive replays of a one-call graph do not reuse one buffer.
    Raises ValueError if more than ``max_copies`` would be needed (a tiny operand: time it differently).
    """
    if bytes_per_copy <= 0:
        raise ValueError(f"bytes_per_copy must be > 0, got {bytes_per_copy}")
    if l2 <= 0:
        raise ValueError(f"l2 must be > 0, got {l2}")
    n = max(min_copies, factor * l2 // bytes_per_copy + 1)
    if n > max_copies:
        raise ValueError(f"{n} copies of {bytes_per_copy} bytes needed to exceed {factor} x L2 ({l2} bytes); "
                         f"at most {max_copies} allowed")
    return int(n)


def _median_per_call(replay: Callable[[], object], calls: int, reps: int) -> tuple[float, float, float]:
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    return statistics.median(times), min(times), max(times)


def _capture(calls: Sequence[Callable[[], object]]) -> torch.cuda.CUDAGraph:
    # A warm-up on a side stream first, as torch.cuda.graphs recommends (lazy init, workspace allocation).
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for call in calls:
            call()
    return graph


def capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """A CUDA graph of one call of ``fn`` (after a warm-up call on a side stream) and what that captured call
    returned: the tensors the graph's replays write."""
    out = []
    graph = _capture([lambda: out.append(fn())])
    return graph, out[-1]


def time_calls(calls: Sequence[Callable[[], object]], reps: int = REPS, warmup: int = WARMUP,
               use_graph: bool = True, warmup_ms: float = WARMUP_MS) -> Timing:
    """Times ``calls`` (one per weight copy) as described in the module docstring.

    The first call is run once eagerly so that compilation and autotuning happen outside the capture. Then
    ``warmup`` replays, and more until about ``warmup_ms`` of replays have run (:data:`WARMUP_MS`).
    """
    if not calls:
        raise ValueError("calls is empty")
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    calls[0]()
    torch.cuda.synchronize()
    mode = "graph"
    replay: Callable[[], object]
    graph = None
    if use_graph:
        try:
            graph = _capture(calls)
            replay = graph.replay
        except Exception:  # noqa: BLE001 - any capture failure falls back to the loop, recorded as mode
            graph = None
            torch.cuda.synchronize()
    if graph is None:
        mode = "loop"

        def replay():
            for call in calls:
                call()
    for _ in range(warmup):
        replay()
    torch.cuda.synchronize()
    if warmup_ms > 0:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        for _ in range(min(10_000, math.ceil(warmup_ms / max(start.elapsed_time(end), 1e-3)) - warmup - 1)):
            replay()
        torch.cuda.synchronize()
    us, lo, hi = _median_per_call(replay, len(calls), reps)
    del graph
    return Timing(us=us, us_min=lo, us_max=hi, calls=len(calls), reps=reps, mode=mode)


def tbps(nbytes: float, us: float) -> float:
    """Bytes moved in ``us`` microseconds, as TB/s (10**12 bytes per second); NaN when us is not > 0."""
    return nbytes / (us * 1e-6) / 1e12 if us and us > 0 else math.nan
