"""Why the first timing of a run came out slow: lab/huge_m1.py timed the dispatcher on 152064x8192 k = 4 M = 1 at
266 us as the first point of the shape and 229 us in the next rounds (106496x16384: 371 / 315). Here, per shape,
each replay of the cold-L2 graph (``kbit.bench.timing``) is timed alone right after the GPU idled for 2 s, then
``time_calls`` (3 warm-up replays) after idling or not, with or without 25 ms of replays of its own graph first.
(The run of 2026-11-27 passed the 25 ms to a ``time_calls`` argument tried then and not kept; the same replays.)

    PYTHONPATH=src python lab/clock_warmup.py [--shapes 152064x8192,4096x4096] [--k 4]

``--fresh`` (timed without ``time_calls``' ``WARMUP_MS``, as when it ran): the dispatcher's ``time_calls`` on
freshly made weight copies, as a suite run makes them, timed at once, again on the same copies, after 2 s of idling,
right after 8 GB were allocated, written and freed, right after bf16 cuBLAS was timed on the shape (as ``kbit bench``
does first; with and without 2 s of idling after it), and right after a humming weight was built (``PYTHONPATH`` with
humming): which of these brings the slow first timing back. ``--settle``: what removes it (:func:`settle`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch  # noqa: E402

from kbit.bench import timing  # noqa: E402
from kbit.bench.tune import Measure, candidate_call, quantized_weight  # noqa: E402


def _table(head: tuple[str, ...], rows: list) -> None:
    """A markdown table: two text columns, then numbers (us)."""
    print("\n| " + " | ".join(head) + " |")
    print("|---|---|" + "--:|" * (len(head) - 2))
    for r in rows:
        print("| " + " | ".join([r[0], r[1], *(f"{v:.2f}" for v in r[2:])]) + " |")


def replays_after_idle(graph_replay, calls: int, n: int) -> list[float]:
    time.sleep(2.0)
    out = []
    for _ in range(n):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph_replay()
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e) * 1000 / calls)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="152064x8192,4096x4096")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--settle", action="store_true")
    a = p.parse_args()
    if a.fresh:
        return fresh(a)
    if a.settle:
        return settle(a)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name(0), flush=True)
    rows = []
    for s in a.shapes.split(","):
        N, K = (int(v) for v in s.split("x"))
        meas = Measure(quantized_weight(N, K, a.k), 15, l2)
        meas.set_m(1, seed=0)
        fns = [candidate_call(None, c) for c in meas.copies]
        x = meas.x
        calls = [lambda f=f, x=x: f(x) for f in fns]
        calls[0]()
        graph = timing._capture(calls)
        seq = replays_after_idle(graph.replay, len(calls), 60)
        print(f"{s}: {len(calls)} copies; replays after 2 s idle, us a call: "
              + " ".join(f"{v:.1f}" for v in seq), flush=True)
        for label, idle, ms in (("idle, warm-up 3 replays", True, 0.0), ("busy, warm-up 3 replays", False, 0.0),
                                ("idle, warm-up 25 ms", True, 25.0), ("busy, warm-up 25 ms", False, 25.0),
                                ("idle, warm-up 3 replays (again)", True, 0.0)):
            if idle:
                time.sleep(2.0)
            t0 = time.perf_counter()
            while (time.perf_counter() - t0) * 1000 < ms:
                graph.replay()
                torch.cuda.synchronize()
            t = timing.time_calls(calls, reps=15, warmup_ms=0)
            rows.append((s, label, t.us, t.us_min, t.us_max))
            print(f"{s} {label}: {t.us:.2f} us (min {t.us_min:.2f}, max {t.us_max:.2f})", flush=True)
        del graph, meas, fns, calls
        torch.cuda.empty_cache()
    _table(("shape", "before the timing", "us (median)", "min", "max"), rows)
    return 0


def fresh(a) -> int:
    import functools

    from kbit.bench import tune
    from kbit.bench.peers import PEERS

    # as run on 2026-11-27: the timings without the warm-up that kbit.bench.timing has since (WARMUP_MS)
    tune.time_calls = functools.partial(timing.time_calls, warmup_ms=0)

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name(0), flush=True)
    hum = PEERS["humming"]
    rows = []
    for s in a.shapes.split(","):
        N, K = (int(v) for v in s.split("x"))

        def before_alloc():
            t = torch.empty(8 << 30, dtype=torch.uint8, device="cuda").fill_(1)
            torch.cuda.synchronize()
            del t

        def before_humming(N=N, K=K):
            W = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
            hum.build(W, a.k)
            torch.cuda.synchronize()

        def before_bf16(N=N, K=K):  # as kbit bench times the shape: bf16 cuBLAS first, 2+ copies, 18 replays
            W = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
            x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
            ws = [W] + [W.clone() for _ in range(timing.copies_for_cold_l2(W.nbytes, l2) - 1)]
            timing.time_calls([lambda w=w: torch.nn.functional.linear(x, w) for w in ws], reps=15)
            torch.cuda.synchronize()
            del ws, W

        steps = [("fresh copies, at once", None), ("fresh copies, after 2 s idle", lambda: time.sleep(2.0)),
                 ("fresh copies, after 8 GB allocated, written, freed", before_alloc),
                 ("fresh copies, after bf16 timed on the shape", before_bf16),
                 ("fresh copies, after bf16 timed, then 2 s idle", lambda: (before_bf16(), time.sleep(2.0)))]
        if hum.unavailable() is None:
            steps.append(("fresh copies, after a humming build", before_humming))
        for label, before in steps:
            meas = Measure(quantized_weight(N, K, a.k), 15, l2)
            meas.set_m(1, seed=0)
            torch.cuda.synchronize()
            if before is not None:
                before()
            first = meas(None)
            again = meas(None)
            rows.append((s, label, first, again))
            print(f"{s} {label}: first {first:.2f} us, again {again:.2f} us", flush=True)
            del meas
            torch.cuda.empty_cache()
    _table(("shape", "before the first timing", "first us", "again us"), rows)
    return 0


def settle(a) -> int:
    """What undoes the slow first timing (``--fresh``). Each shape's dispatcher calls are timed after bf16 was timed
    on copies of an existing bf16 weight (memory from the allocator's cache), and after 8 GB of new device memory
    were allocated, written and freed. Each time with one remedy: 3 warm-up replays (none), 100, a graph captured
    and dropped first, the allocator's cache emptied first, or 25 / 50 / 100 ms of replays (``warmup_ms``); then
    timed again plainly."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name(0), flush=True)
    rows = []
    for s in a.shapes.split(","):
        _settle_shape(s, a.k, l2, rows)
        torch.cuda.empty_cache()
    _table(("shape", "after", "first us", "again us"), rows)
    return 0


def _settle_shape(s: str, k: int, l2: int, rows: list) -> None:
    N, K = (int(v) for v in s.split("x"))
    W = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)
    xb = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    meas = Measure(quantized_weight(N, K, k), 15, l2)
    meas.set_m(1, seed=0)
    fns = [candidate_call(None, c) for c in meas.copies]
    x = meas.x
    calls = [lambda f=f: f(x) for f in fns]

    def bf16():
        ws = [W] + [W.clone() for _ in range(timing.copies_for_cold_l2(W.nbytes, l2) - 1)]
        timing.time_calls([lambda w=w: torch.nn.functional.linear(xb, w) for w in ws], reps=15)
        torch.cuda.synchronize()

    def alloc():  # --fresh's "8 GB allocated, written, freed": new memory from the driver each time
        torch.cuda.empty_cache()
        t = torch.empty(8 << 30, dtype=torch.uint8, device="cuda").fill_(1)
        torch.cuda.synchronize()
        del t

    def variant(label, prep, **kw):
        (alloc if big else bf16)()
        prep()
        t1 = timing.time_calls(calls, reps=15, **kw).us
        t2 = timing.time_calls(calls, reps=15, warmup_ms=0).us
        rows.append((s, label, t1, t2))
        print(f"{s} after {label}: first {t1:.2f} us, again {t2:.2f} us", flush=True)

    for big in (False, True):
        what = "8 GB allocated, written, freed" if big else "bf16"
        variant(f"{what}; 3 warm-up replays", lambda: None, warmup_ms=0)
        variant(f"{what}; 100 warm-up replays", lambda: None, warmup=100, warmup_ms=0)
        variant(f"{what}; a graph captured and dropped first", lambda: timing._capture(calls), warmup_ms=0)
        variant(f"{what}; torch.cuda.empty_cache() first", torch.cuda.empty_cache, warmup_ms=0)
        for ms in (25, 50, 100):
            variant(f"{what}; warm-up {ms} ms", lambda: None, warmup_ms=ms)


if __name__ == "__main__":
    sys.exit(main())
