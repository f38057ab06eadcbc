"""M = 1 on the suite's largest layers, where the suite run and the tuner disagree: 152064x8192 k = 4 took 280 us
through the dispatcher in ``benchmarks/results/h100/suite-k4-2026-11-27.json`` (humming 261), while the tuned table
timed the same kernel-1 config at 229 us. Here each kbit config, humming and bf16 cuBLAS are timed in turns (cold
L2, CUDA graphs: ``kbit.bench.tune.Measure`` / ``kbit.bench.timing.time_calls``), several rounds, with the SM clock,
memory clock and power sampled by ``nvidia-smi`` during each timing, to tell clocks from kernels.

    PYTHONPATH=src python lab/huge_m1.py [--shapes 152064x8192,106496x16384] [--k 4] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kbit.bench.peers import PEERS  # noqa: E402
from kbit.bench.timing import copies_for_cold_l2, time_calls  # noqa: E402
from kbit.bench.tune import Measure, quantized_weight  # noqa: E402
from kbit.tuning.mma import MmaConfig  # noqa: E402
from kbit.tuning.space import Candidate  # noqa: E402

CONFIGS = {"k1 w4 c4": MmaConfig(1, 4, min_ctas=4), "k1 w8 c2": MmaConfig(1, 8, min_ctas=2),
           "k3 w8 c2 ring2 xs": MmaConfig(3, 8, min_ctas=2, ring=2, x_smem=True),
           "k3 w8 c2 xs": MmaConfig(3, 8, min_ctas=2, x_smem=True)}


class Sampler:
    """nvidia-smi every 50 ms in the background: (time, SM MHz, memory MHz, watts)."""

    def __init__(self):
        self.p = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,clocks.mem,power.draw",
                                   "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
        self.rows = []

    def stop(self):
        self.p.terminate()
        out, _ = self.p.communicate()
        for line in out.splitlines():
            try:
                ts, sm, mem, w = (v.strip() for v in line.split(","))
                t = datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                self.rows.append((t, float(sm), float(mem), float(w)))
            except ValueError:
                continue

    def window(self, t0, t1) -> str:
        r = [x for x in self.rows if t0 <= x[0] <= t1]
        if not r:
            return "no samples"
        sm = [x[1] for x in r]
        return (f"SM {min(sm):.0f}-{max(sm):.0f} MHz (median {statistics.median(sm):.0f}), mem "
                f"{statistics.median(x[2] for x in r):.0f} MHz, {max(x[3] for x in r):.0f} W max, {len(r)} samples")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="152064x8192,106496x16384")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=30)
    a = p.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(torch.cuda.get_device_name(0), flush=True)
    samp = Sampler()
    windows = []  # (label, us, t0, t1)
    for s in a.shapes.split(","):
        one_shape(s, a, l2, windows)
        torch.cuda.empty_cache()
    samp.stop()
    print("\n| point | us | clocks during the timing |")
    print("|---|--:|---|")
    for label, us, t0, t1 in windows:
        print(f"| {label} | {us:.2f} | {samp.window(t0, t1)} |")
    return 0


def one_shape(s: str, a, l2: int, windows: list) -> None:
    N, K = (int(v) for v in s.split("x"))
    hum = PEERS["humming"]
    qw = quantized_weight(N, K, a.k)
    W = (torch.randn(N, K, device="cuda") * 0.02).to(torch.bfloat16)  # timing only: any values do
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    meas = Measure(qw, a.reps, l2)
    meas.set_m(1, seed=0)
    pw = hum.build(W, a.k) if hum.unavailable() is None else None
    hcopies = [] if pw is None else [pw.state] + [hum.copy(pw.state) for _ in range(
        copies_for_cold_l2(pw.nbytes, l2) - 1)]
    bcopies = [W] + [W.clone() for _ in range(copies_for_cold_l2(W.numel() * 2, l2) - 1)]
    jobs = [("dispatcher", lambda: meas(None))]
    jobs += [(name, lambda c=c: meas(Candidate("mma", c))) for name, c in CONFIGS.items()]
    if hcopies:
        jobs.append(("humming", lambda: time_calls([hum.bind(st, x) for st in hcopies], reps=a.reps).us))
    jobs.append(("bf16", lambda: time_calls([lambda w=w: F.linear(x, w) for w in bcopies], reps=a.reps).us))
    for rnd in range(a.rounds):
        for name, fn in jobs:
            t0 = time.time()
            us = fn()
            t1 = time.time()
            windows.append((f"{s} r{rnd} {name}", us, t0, t1))
            print(f"{s} round {rnd} {name:20s} {us:9.2f} us", flush=True)


if __name__ == "__main__":
    sys.exit(main())
