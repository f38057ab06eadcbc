"""GPU A/B of the dense dispatcher with the tuned table kbit ships for this GPU against its built-in rules (the table
hidden), in one process: per (N x K, k, M) the time of ``kbit.dispatch.linear.linear`` both ways, cold L2 (weight
copies > 8 x L2, one CUDA graph; ``kbit.bench.timing``), bf16 ``F.linear`` beside it, and the backend each way
picked. Table on, off, on again: a point counts as changed when both "on" times agree on the side of "off".

    PYTHONPATH=src python lab/suite/table_ab.py [--shapes 4096x14336,...] [--ks 4,2] [--ms 1,4,16,64,256,1024]

The default shapes are the decode step's layers of Llama-3-8B / Qwen2.5-7B / Qwen3-8B (fused q/k/v and gate/up as
``quantize_model`` fuses them, o_proj, down_proj) and the five benchmark shapes: the shapes the built-in rules were
hand-tuned on, where a table's guess for an untuned shape could lose.
"""
from __future__ import annotations

import argparse
import functools
import statistics

import torch
import torch.nn.functional as F

from kbit import quantize
from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls
from kbit.bench.weights import clone_weight, kbit_bytes
from kbit.dispatch import linear as D
from kbit.ops import gemv_mma
from kbit.tuning import tuned
from kbit.tuning.tables import gpu_key

SHAPES = ("6144x4096,4096x4096,28672x4096,4096x14336,"   # Llama-3-8B: qkv, o, gate_up, down
          "4608x3584,3584x3584,37888x3584,3584x18944,"   # Qwen2.5-7B
          "6144x4096,4096x4096,24576x4096,4096x12288,"   # Qwen3-8B (q 4096 + k/v 1024 each)
          "57344x8192,8192x28672")                        # benchmark shapes not above


def _table(on: bool) -> None:
    """Show or hide the shipped / user tables from the dispatcher (its caches cleared either way)."""
    D.tuned_candidate = tuned.tuned_candidate if on else (lambda *a: None)
    gemv_mma.tuned_candidate = D.tuned_candidate
    D._choice.cache_clear()
    gemv_mma.PLANS.clear()


def _kbit_call(x, w):
    return D.linear(x, w.codes, w.scales, w.tensor_scale, w.codebook, k=w.k, blocksize=w.blocksize,
                    scale_format=w.scale_format, N=w.shape[-2], K=w.shape[-1])


def _backend(M: int, N: int, K: int, k: int, dev) -> str:
    try:
        ch = D.choice(M, N, K, k, dev)
        return ch.kernel if ch is not None else "?"
    except Exception as e:  # noqa: BLE001 - a name for the table, not a failure of the run
        return type(e).__name__


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--ks", default="4,2")
    ap.add_argument("--ms", default="1,4,16,64,256,1024")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gpu = gpu_key(dev)
    print(f"{torch.cuda.get_device_name()} ({gpu}); shipped table: {tuned.packaged_path(gpu).is_file()}")
    shapes = list(dict.fromkeys(args.shapes.split(",")))
    rows = []
    for shape in shapes:
        N, K = map(int, shape.split("x"))
        for k in map(int, args.ks.split(",")):
            torch.manual_seed(0)
            qw = quantize(torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02, k=k)
            n = copies_for_cold_l2(kbit_bytes(qw), l2_bytes(dev))
            ws = [qw] + [clone_weight(qw) for _ in range(n - 1)]
            wb = torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02
            nb = copies_for_cold_l2(N * K * 2, l2_bytes(dev))
            wbs = [wb] + [wb.clone() for _ in range(nb - 1)]
            for M in map(int, args.ms.split(",")):
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                calls = [functools.partial(_kbit_call, x, w) for w in ws]
                t, picks = {}, {}
                for tag, on in (("on1", True), ("off", False), ("on2", True)):
                    _table(on)
                    picks[on] = _backend(M, N, K, k, dev)
                    t[tag] = time_calls(calls).us
                bf16 = time_calls([functools.partial(F.linear, x, w) for w in wbs]).us
                on = statistics.mean((t["on1"], t["on2"]))
                rows.append((shape, k, M, t["off"], t["on1"], t["on2"], on / t["off"], bf16, picks[False], picks[True]))
                print(f"{shape} k={k} M={M}: built-in {t['off']:.2f} us ({picks[False]}), table {t['on1']:.2f} / "
                      f"{t['on2']:.2f} us ({picks[True]}), bf16 {bf16:.2f}", flush=True)
            del ws, wbs
            torch.cuda.empty_cache()
    _table(True)
    print("\n| N x K | k | M | built-in us | table us (two runs) | table / built-in | bf16 us | backend built-in -> "
          "table |")
    print("|---|--:|--:|--:|--:|--:|--:|---|")
    for s, k, M, off, on1, on2, r, bf, pb, pt in rows:
        print(f"| {s} | {k} | {M} | {off:.2f} | {on1:.2f} / {on2:.2f} | {r:.3f} | {bf:.2f} | {pb} -> {pt} |")
    worse = [r for r in rows if min(r[4], r[5]) > 1.03 * r[3]]
    better = [r for r in rows if max(r[4], r[5]) < r[3] / 1.03]
    ratios = [r[6] for r in rows]
    print(f"\n{len(rows)} points: table / built-in median {statistics.median(ratios):.3f}, best {min(ratios):.3f}, "
          f"worst {max(ratios):.3f}; table faster by > 3% (both runs) at {len(better)}, slower by > 3% at {len(worse)}"
          + "".join(f"\n  slower: {r[0]} k={r[1]} M={r[2]} {r[3]:.2f} -> {r[4]:.2f}/{r[5]:.2f}" for r in worse))


if __name__ == "__main__":
    main()
