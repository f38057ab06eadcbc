"""What the device-side id checks (``kbit.ops._ids``) cost an MoE decode step: ``KbitMoE`` forward at T = 1 in a
CUDA graph, Qwen3-30B-A3B's shape (128 experts, top-8, hidden 2048, moe_intermediate 768), k = 4, bf16.

The check has no switch (it is not optional), so "without" comes from elsewhere:

- the GEMV decode step (the default plan at T = 1): the check is a few compares inside the grouped GEMV and the
  combine kernels. Its cost is the difference between this tree and the tree before the check (83ced6e), run in
  one call on one machine, twice each, alternating (the spread of the repeats is the noise floor)::

      mkdir -p _trees/83ced6e && git archive 83ced6e src | tar -x -C _trees/83ced6e
      TREES="83ced6e . 83ced6e ." TAIL=6 bash lab/ab_trees.sh python -u lab/ids_cost.py

- the grouped tensor-core GEMM step (a stack in layout "mma-v1", the ``| kbit repacked`` row): the layer's own
  router makes ids in range by construction (``MoeRouting.checked``), so the step runs no check: the same A/B
  shows it. A routing from elsewhere (``align`` of a caller's ``topk_ids``) pays two small launches a GEMM
  (``kbit.ops._ids.guard`` before, ``poison`` after): timed alone, in a graph, on the step's ids, and reported as
  a share of the step (this tree only; not part of the step above).

Also times ``kbit.sample`` at B = 1 and 64 (its edge-case semantics add a row-max launch, split over many
programs a row: same A/B).

Cold L2: enough layer copies (each its own router logits) that one replay reads every touched expert from HBM.
Prints ``| kbit ...`` rows (the lines ab_trees.sh shows); writes ``ids_cost.json`` under ``$OUT`` if set.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

if not os.environ.get("PYTHONPATH"):  # ab_trees.sh points PYTHONPATH at the tree under test
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

import kbit  # noqa: E402
from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402

E, TOP_K, H, I = 128, 8, 2048, 768


def layers(n: int, repacked: bool):
    """``n`` equal layers (copies: each replay reads its own experts from HBM)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    base = kbit.KbitMoE.from_float(torch.randn(E, 2 * I, H, generator=g, device="cuda") / H**0.5,
                                   torch.randn(E, H, I, generator=g, device="cuda") / I**0.5, top_k=TOP_K, k=4,
                                   dtype=torch.bfloat16).cuda()
    out = [base] + [copy.deepcopy(base) for _ in range(n - 1)]
    if repacked:
        for m in out:
            m.repack_for_kernels()
    return out


def step_time(repacked: bool, reps: int) -> float:
    touched = TOP_K * 3 * H * I * 4 // 8  # bytes of the experts one token reads
    n = max(2, copies_for_cold_l2(touched, l2_bytes()))
    ms = layers(n, repacked)
    x = torch.randn(1, H, device="cuda").bfloat16()
    logits = [torch.randn(1, E, device="cuda").bfloat16() for _ in ms]
    calls = [lambda m=m, lg=lg: m(x, lg) for m, lg in zip(ms, logits, strict=True)]
    return time_calls(calls, reps=reps).us


def guard_time(reps: int) -> float | None:
    """Two guards and two poisons (the id checks of a GEMM step on a caller's routing, not a routed one) alone, on
    a decode step's ids."""
    try:
        from kbit.ops import _ids  # absent in trees before the check
    except ImportError:
        return None
    rows = torch.zeros(TOP_K, dtype=torch.int32, device="cuda")
    eids = torch.randperm(E, device="cuda")[:TOP_K].int()
    y1 = torch.empty(TOP_K, 2 * I, device="cuda").bfloat16()
    y2 = torch.empty(TOP_K, H, device="cuda").bfloat16()

    def checks():
        _, _, bad = _ids.guard(rows, 1, eids, E)
        _ids.poison(y1, bad)
        _, _, bad = _ids.guard(rows, TOP_K, eids, E)
        _ids.poison(y2, bad)

    return time_calls([checks], reps=reps).us


def sample_time(B: int, reps: int) -> float:
    """``kbit.sample`` (top-k 50, top-p 0.9, T 0.7) on ``[B, 151936]`` bf16 logits: the row-max launch of the
    edge-case semantics is in this tree's step, not in 83ced6e's."""
    x = torch.randn(B, 151936, device="cuda").bfloat16()
    seed = torch.tensor([1], device="cuda")
    off = torch.zeros(1, dtype=torch.int64, device="cuda")
    return time_calls([lambda: kbit.sample(x, temperature=0.7, top_k=50, top_p=0.9, seed=seed, offset=off)],
                      reps=reps).us


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    print(f"kbit from {kbit.__file__} on {torch.cuda.get_device_name()}", flush=True)
    res = {"gemv_step_us": step_time(False, a.reps), "gemm_step_us": step_time(True, a.reps),
           "gemm_checks_us": guard_time(a.reps)}
    print(f"| kbit decode T=1 gemv step | {res['gemv_step_us']:.2f} us |")
    print(f"| kbit repacked T=1 gemm step | {res['gemm_step_us']:.2f} us |")
    for B in (1, 64):
        res[f"sample_b{B}_us"] = sample_time(B, a.reps)
        print(f"| kbit sample B={B} V=151936 | {res[f'sample_b{B}_us']:.2f} us |")
    if res["gemm_checks_us"] is not None:
        share = 100 * res["gemm_checks_us"] / res["gemm_step_us"]
        print(f"| kbit gemm step id checks of a caller's routing, alone | {res['gemm_checks_us']:.2f} us = "
              f"{share:.2f}% of the step |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "ids_cost.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
