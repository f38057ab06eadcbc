"""GPU lab: k = 5's pair table (``MmaConfig.pair_table``, the ``P5`` build of kernel 3) against the dispatcher's
choice and against the same launch geometry without the table, timed as ``kbit bench`` times (one CUDA graph over
weight copies > 8x L2, median of 15 replays, bf16 activations, log8 B = 32); humming w5 in the same run where it
imports. First checks every pair-table config against the float64 reference on odd shapes.

    PYTHONUNBUFFERED=1 python lab/p5_ab.py [--shapes 128256x16384,...] [--ms 1,4,16]
        [--cfgs "3,16,1,2,1,0,1;3,16,1,2,1"] [--humming] [--out DIR]

Configs are ``MmaConfig.of``'s positional form; the first column is always the dispatcher (``default``).
"""
import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import mma_lab as L  # noqa: E402
import torch  # noqa: E402

from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402
from kbit.ops import gemv_mma as MM  # noqa: E402
from kbit.ops.mma.common import x_rows  # noqa: E402
from kbit.tuning.mma import MmaConfig  # noqa: E402

SHAPES = ("128256x16384,152064x8192,16384x53248,151936x5120,57344x8192,5120x25600,8192x28672,28672x4096,"
          "4096x14336,9216x4096,6144x4096,4096x4096")
CFGS = "3,16,1,2,1,0,1;3,16,1,3,1,0,1;3,32,1,2,1,0,1;3,8,1,2,1,0,1;3,16,1,2,1"


def time_kbit(N, K, M, cfg):
    ws = L.copies(N, K, 5)
    x = x_rows(torch.randn(M, K, dtype=torch.bfloat16, device="cuda"), -(-K // 256))
    y = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
    kw = dict(k=5, scale_format="log8", N=N, K=K, M=M, config=cfg)
    MM.PLANS.clear()
    return time_calls([(lambda w=w: MM.launch(x, w[0], w[1], w[2], w[3], None, y, **kw)) for w in ws]).us


def same_output(N, K, M, cfg):
    """Relative difference of cfg's output from the dispatcher's on copy 0 (the same codes)."""
    w = L.copies(N, K, 5)[0]
    x = x_rows(torch.randn(M, K, dtype=torch.bfloat16, device="cuda"), -(-K // 256))
    ys = []
    for c in (None, cfg):
        y = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
        MM.launch(x, w[0], w[1], w[2], w[3], None, y, k=5, scale_format="log8", N=N, K=K, M=M, config=c)
        ys.append(y.double())
    return ((ys[1] - ys[0]).norm() / ys[0].norm()).item()


def humming_us(N, K, M):
    from kbit.bench.peers import Humming

    h = Humming()
    if h.unavailable():
        return float("nan")
    W = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    pw = h.build(W, 5)
    del W
    n = copies_for_cold_l2(pw.nbytes, l2_bytes())
    states = [pw.state] + [h.copy(pw.state) for _ in range(n - 1)]
    x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
    t = time_calls([h.bind(s, x) for s in states]).us
    del states, pw
    torch.cuda.empty_cache()
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--ms", default="1,4,16")
    ap.add_argument("--cfgs", default=CFGS)
    ap.add_argument("--humming", action="store_true", help="humming w5 in the same run (M = 1 only)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    a = ap.parse_args()
    cfgs = [MmaConfig.of(tuple(int(v) for v in c.split(","))) for c in a.cfgs.split(";") if c]
    ms = [int(v) for v in a.ms.split(",")]
    t0 = time.time()
    lines = [f"# {torch.cuda.get_device_name()}; k = 5, bf16, log8 B = 32; us a call (cold L2, graph, median of 15)"]

    def out(s):
        print(s, flush=True)
        lines.append(s)

    if not a.no_check:
        cases = [c for M in sorted(set(ms) | {3, 8}) for c in (
            (2880, 5120, 5, M, torch.bfloat16, 32, "log8", False), (5120, 2880, 5, M, torch.float16, 32, "log8", True),
            (1000, 4000, 5, M, torch.float16, 128, "log8", True), (17, 300, 5, M, torch.bfloat16, 64, "fp16", False))]
        n_fail = 0
        for cfg in cfgs:
            MM.PLANS.clear()
            n_fail += len(L.run_cases(cases, config=cfg, log_every=1000))
        out(f"# check against float64: {len(cases) * len(cfgs)} cases, {n_fail} failures ({time.time() - t0:.0f} s)")
    names = ["default"] + [",".join(str(v) for v in c.legacy(5)) for c in cfgs]
    out("| N x K | M | " + " | ".join(names) + (" | humming w5" if a.humming else "") + " | best / default |")
    out("|---|--:|" + "--:|" * (len(names) + 1 + a.humming))
    for s in a.shapes.split(","):
        N, K = (int(v) for v in s.split("x"))
        for M in ms:
            us = []
            for c in [None] + cfgs:
                try:
                    us.append(time_kbit(N, K, M, c))
                except Exception as e:  # noqa: BLE001 - a config that cannot launch here is a blank
                    print(f"{s} M={M} {c}: {repr(e)[:200]}", flush=True)
                    us.append(float("nan"))
            diffs = [same_output(N, K, M, c) for c in cfgs if c.pair_table]
            hm = humming_us(N, K, M) if a.humming and M == 1 else None
            best = min(u for u in us if u == u)
            row = f"| {s} | {M} | " + " | ".join(f"{u:.2f}" for u in us)
            row += (f" | {hm:.2f}" if hm is not None else " | -" if a.humming else "")
            out(row + f" | {best / us[0]:.3f} |")
            if max(diffs, default=0) > 1e-2:
                out(f"# {s} M={M}: a pair-table output differs from the dispatcher's by {max(diffs):.2e}")
        L._COPIES.clear()
        torch.cuda.empty_cache()
    out(f"# {time.time() - t0:.0f} s")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "p5_ab.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
