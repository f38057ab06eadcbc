"""GPU lab: whole MoE layers of a few tokens (the fused router, the pairs launches, the combine), the SwiGLU staged by
the down pairs launch against its own launch, to check ``kbit.tuning.moe.PAIRS_SILU_MAX`` on MoE shapes it was not
set on (it was set on Qwen3-30B-A3B- and Mixtral-shaped decode steps). On those shapes the staging did not hold
(benchmarks/results/h200/moe-next-2026-11-29/) and was removed; ``lab/patches/moe-pairs-silu-staging.patch`` puts
it back. In a tree without it the script times the layer as it runs (the "launch" column only).

    PYTHONUNBUFFERED=1 python lab/moe_silu_bound_lab.py [--models ...] [--tokens 1,2,4,8] [--out DIR]

Each (model, T): a ``KbitMoE`` layer in layout "mma-v1" with a router weight (random codes, k = 4, bf16), hidden in,
hidden out (the router in the layer's own launch at these sizes), the plan the layer picks, timed
(``kbit.bench.timing.time_calls``: CUDA graphs) with the SwiGLU always staged and always in its own launch (the
bound set to 10**9 and to 0), rotating over layer copies (together over 8x L2) and fresh inputs a copy. A tree
with another down launch (``lab/patches/moe-pairs-combine.patch`` applied) runs the same script through its own
PYTHONPATH. Prints a table (us, the ratio, pairs x I, whether the bound picks the faster) and writes
``moe_silu_bound_lab.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

import kbit.dispatch.moe as DM  # noqa: E402
from kbit.bench.timing import time_calls  # noqa: E402


def main():
    # after kbit (from PYTHONPATH: a tree under test), as moe_pairs_rule_lab puts this checkout's src on the path
    from moe_pairs_rule_lab import lab_args, model_layers

    a, out = lab_args()
    bound = getattr(DM, "PAIRS_SILU_MAX", None)  # None: a tree from before the staged SwiGLU (its own launch only)
    variants = (("staged", 10**9), ("launch", 0)) if bound is not None else (("launch", None),)
    rows = []
    for name, (E, top, H, I), layers in model_layers(a.models.split(","), a.budget, router=True):
        n = len(layers)
        for T in (int(t) for t in a.tokens.split(",")):
            if T * top > 64:
                continue
            g = torch.Generator(device="cuda").manual_seed(T)
            xs = [torch.randn(T, H, device="cuda", generator=g).bfloat16() for _ in layers]
            r = dict(model=name, T=T, E=E, top_k=top, H=H, I=I, staged_values=T * top * I, copies=n,
                     plan=str(layers[0].plan_for(T)))
            ys = {}
            for label, b in variants:
                if b is not None:
                    DM.PAIRS_SILU_MAX = b
                try:
                    ys[label] = layers[0](xs[0]).double()
                    r[label] = time_calls([(lambda m=m, x=x: m(x)) for m, x in zip(layers, xs, strict=True)]).us
                finally:
                    if b is not None:
                        DM.PAIRS_SILU_MAX = bound
            if "staged" in ys:
                r["rel_diff"] = ((ys["staged"] - ys["launch"]).norm() / ys["launch"].norm()).item()
            rows.append(r)
            print(r, flush=True)
            (out / "moe_silu_bound_lab.json").write_text(json.dumps(dict(
                gpu=torch.cuda.get_device_name(), commit=os.environ.get("KBIT_COMMIT", "?"), bound=bound,
                rows=rows), indent=1))
    print(f"\nbound (pairs x I): {bound}")
    if bound is None:
        print("| model | T | pairs x I | launch us |\n|---|--:|--:|--:|")
        for r in rows:
            print(f"| {r['model']} | {r['T']} | {r['staged_values']} | {r['launch']:.1f} |")
        return
    print("| model | T | pairs x I | staged us | launch us | launch / staged | bound stages | faster picked |")
    print("|---|--:|--:|--:|--:|--:|---|---|")
    for r in rows:
        stages = r["staged_values"] <= bound
        faster = r["staged"] < r["launch"]
        print(f"| {r['model']} | {r['T']} | {r['staged_values']} | {r['staged']:.1f} | {r['launch']:.1f} | "
              f"{r['launch'] / r['staged']:.3f} | {'yes' if stages else 'no'} | "
              f"{'yes' if stages == faster else 'no'} |")


if __name__ == "__main__":
    main()
