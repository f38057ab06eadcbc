"""GPU lab: the pairs launch against the grouped kernels for whole MoE layers of a few tokens, to check the rule
that picks between them (``kbit.tuning.moe.pairs_rereads`` <= ``PAIRS_MAX_REREAD``) on MoE shapes it was not set on.

    PYTHONUNBUFFERED=1 python lab/moe_pairs_rule_lab.py [--models ...] [--tokens 1,2,4,8] [--out DIR]

Each (model, T): a ``KbitMoE`` layer in layout "mma-v1" (random codes and scales, k = 4, bf16), router logits in,
hidden out, timed with the plan pinned to ``pairs`` / ``gemm`` (``kbit.bench.timing.time_calls``: CUDA graphs),
rotating over layer copies (the stacks together over 8x L2) and fresh router logits a copy. Prints a table (us, the
ratio, the rule's pick and whether it picked the faster) and writes ``moe_pairs_rule_lab.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402
from kbit.dispatch.moe import MoePlan, plan_for_layout  # noqa: E402
from kbit.nn import KbitMoE  # noqa: E402
from kbit.tuning.moe import pairs_rereads  # noqa: E402

# (experts, top_k, hidden, expert intermediate) from the models' config.json
MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336),
          "qwen3-235b-a22b": (128, 8, 4096, 1536), "gpt-oss-120b": (128, 4, 2880, 2880),
          "glm-4.5-air": (128, 8, 4096, 1408), "deepseek-v3": (256, 8, 7168, 2048),
          "olmoe-1b-7b": (64, 8, 2048, 1024), "qwen3-next-80b": (512, 10, 2048, 512)}
PAIRS, GEMM = MoePlan("pairs", "pairs"), MoePlan("gemm", "gemm")


def layer(E, top, H, I, seed, router=False):
    """A repacked KbitMoE of random codes (scales in log8's range, tensor scales ~1e-2); ``router``: with a random
    router weight (the layer routes hidden states itself)."""
    m = KbitMoE(E, H, I, top, k=4, dtype=torch.bfloat16, device="cuda", has_router_weight=router)
    g = torch.Generator(device="cuda").manual_seed(seed)
    for name, b in m.named_buffers():
        if b.dtype == torch.int32:
            b.copy_(torch.randint(-(2**31), 2**31 - 1, b.shape, generator=g, dtype=torch.int32, device="cuda"))
        elif b.dtype == torch.uint8:
            b.copy_(torch.randint(20, 44, b.shape, generator=g, dtype=torch.uint8, device="cuda"))
        elif name.endswith("codebook"):
            b.copy_(torch.sort(torch.rand(b.shape, generator=g, device="cuda") * 2 - 1).values)
        elif name == "router_weight":
            b.copy_(torch.randn(b.shape, generator=g, device="cuda").to(b.dtype) / H**0.5)
        else:
            b.copy_(torch.rand(b.shape, generator=g, device="cuda") * 0.01 + 0.005)
    return m.repack_for_kernels()


def model_layers(names, budget, router=False):
    """(name, (E, top_k, H, I), copies of its layer) for each model of ``names`` until ``budget`` seconds have passed:
    enough copies that their stacks together exceed 8x L2 (cold weights when timed in rotation); freed after."""
    t0 = time.time()
    for name in names:
        E, top, H, I = MODELS[name]
        if time.time() - t0 > budget:
            print("budget reached", flush=True)
            break
        one = 3 * I * H * 4 / 8 + 3 * I * H / 32  # an expert's bytes: codes and log8 scales of gate_up and down
        n = copies_for_cold_l2(int(one * E), l2_bytes())
        layers = [layer(E, top, H, I, seed=i, router=router) for i in range(n)]
        yield name, (E, top, H, I), layers
        del layers
        torch.cuda.empty_cache()


def lab_args():
    """(arguments, output folder) of the MoE layer labs: --models, --tokens, --budget (seconds), --out."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("--budget", type=float, default=200)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    return a, out


def main():
    a, out = lab_args()
    rows = []
    for name, (E, top, H, I), layers in model_layers(a.models.split(","), a.budget):
        n = len(layers)
        for T in (int(t) for t in a.tokens.split(",")):
            if T * top > 64:
                continue
            g = torch.Generator(device="cuda").manual_seed(T)
            xs = [(torch.randn(T, H, device="cuda", generator=g).bfloat16(),
                   torch.randn(T, E, device="cuda", generator=g).bfloat16()) for _ in layers]
            r = dict(model=name, T=T, E=E, top_k=top, H=H, I=I, rereads=pairs_rereads(T, top, E), copies=n)
            ys = {}
            for pname, plan in (("pairs", PAIRS), ("gemm", GEMM)):
                ys[pname] = layers[0](*xs[0], plan=plan).double()
                t = time_calls([(lambda m=m, x=x, plan=plan: m(*x, plan=plan)) for m, x in zip(layers, xs,
                                                                                              strict=True)])
                r[pname] = t.us
            r["rel_diff"] = ((ys["pairs"] - ys["gemm"]).norm() / ys["gemm"].norm()).item()
            pick = plan_for_layout(T, top, E, H, I, torch.bfloat16, "cuda", repacked=True, auto_repack=True)
            r["picked"] = pick.gate_up
            rows.append(r)
            print(r, flush=True)
            (out / "moe_pairs_rule_lab.json").write_text(json.dumps(dict(
                gpu=torch.cuda.get_device_name(), commit=os.environ.get("KBIT_COMMIT", "?"), rows=rows), indent=1))
    print("\n| model | T | expected reads | pairs us | gemm us | gemm / pairs | picked | faster picked |")
    print("|---|--:|--:|--:|--:|--:|---|---|")
    for r in rows:
        faster = "pairs" if r["pairs"] < r["gemm"] else "gemm"
        print(f"| {r['model']} | {r['T']} | {r['rereads']:.2f} | {r['pairs']:.1f} | {r['gemm']:.1f} | "
              f"{r['gemm'] / r['pairs']:.3f} | {r['picked']} | {'yes' if faster == r['picked'] else 'no'} |")


if __name__ == "__main__":
    main()
