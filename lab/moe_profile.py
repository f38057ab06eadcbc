"""GPU lab: per-kernel time of the whole MoE layer (kbit and the bf16 baseline of bench_moe) under torch.profiler.

For each model / T: one KbitMoE and one Bf16MoE (bench_moe's), several weight copies rotated so the L2 is cold,
N forwards of each profiled; prints the CUDA kernels' summed time per forward, largest first.

    PYTHONUNBUFFERED=1 python lab/moe_profile.py [--models qwen3-30b-a3b,mixtral-8x7b] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from bench_moe import MODELS, Bf16MoE, inputs, kbit_copy, make_model  # noqa: E402

LOG = []


def log(*a):
    s = " ".join(str(v) for v in a)
    print(s, flush=True)
    LOG.append(s)


def profile(calls, reps):
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    for c in calls:
        c()
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps):
            for c in calls:
                c()
        torch.cuda.synchronize()
    tot = defaultdict(float)
    cnt = defaultdict(int)
    for e in p.events():
        if e.device_type.name == "CUDA":
            tot[e.name] += e.device_time
            cnt[e.name] += 1
    n = reps * len(calls)
    rows = sorted(((v / n, cnt[k] / n, k) for k, v in tot.items()), reverse=True)
    return rows, sum(r[0] for r in rows)


def report(title, layers, x, logits, reps):
    """Profile ``reps`` forwards of every layer in turn (weight copies: a cold L2) and log the top kernels."""
    rows, total = profile([(lambda lay=lay: lay(x, logits)) for lay in layers], reps)
    log(f"{title}: kernel sum {total:.1f} us / forward")
    for us, c, k in rows[:14]:
        log(f"  {us:8.1f} us  x{c:4.1f}  {k[:110]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b")
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    out = Path(os.environ.get("OUT", "."))
    for name in a.models.split(","):
        m = MODELS[name]
        layer, w_gu, w_dn = make_model(m, a.k)
        for T in (int(t) for t in a.tokens.split(",")):
            x, logits = inputs(m, T)
            with torch.no_grad():
                kbit = [layer] + [kbit_copy(layer) for _ in range(a.copies - 1)]
                report(f"\n== {name} T={T} kbit k={a.k}", kbit, x, logits, a.reps)
                del kbit
                torch.cuda.empty_cache()
                bf16 = [Bf16MoE(w_gu, w_dn, layer)] + [Bf16MoE(w_gu.clone(), w_dn.clone(), layer)
                                                        for _ in range(min(a.copies, 3) - 1)]
                report(f"== {name} T={T} bf16", bf16, x, logits, a.reps)
                del bf16
                torch.cuda.empty_cache()
        del layer, w_gu, w_dn
        torch.cuda.empty_cache()
    (out / "moe_profile.log").write_text("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
