"""GPU lab (issue 36): the decode attention's rule with 4 warps where it gives 2, timed in the decode step.

    PYTHONUNBUFFERED=1 python lab/attn_warps_ab.py [--models llama3-8b,qwen2.5-7b,qwen3-30b-a3b] [--layers 8]
        [--ctx 512] [--batch 1,4,16]

With 2 warps and the first block prefetched before the PDL wait, ``split_kernel`` holds four [32, 128] K / V tiles
in 64 threads: ptxas for sm_90 gives it 255 registers and 488 bytes of stack (123 spill stores) at D = 128; with 4
warps, 8 bytes. For each model (bench_e2e's shapes, the first ``--layers`` layers, k = 4, q/k/v and gate/up fused)
and (batch, context) the step is timed with ``attention_config`` as shipped and with its num_warps raised from 2 to
4, alternating twice (lab/attn_chain_sweep.py's ``timed``). Prints us a layer against the rule, a short table last;
writes ``attn_warps_ab.json`` under ``--out``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "lab"))

import attn_chain_sweep as S  # noqa: E402
import torch  # noqa: E402

E, A = S.E, S.A


def rule_w4(*a, **kw):
    cfg = S.RULE(*a, **kw)
    return dataclasses.replace(cfg, num_warps=4) if cfg.num_warps == 2 else cfg


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama3-8b,qwen2.5-7b,qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ctx", default="512")
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.tiny else "cuda"
    cfgs = E.configs(tiny=args.tiny)
    rows: list = []
    for name in args.models.split(","):
        config = E.with_layers(cfgs[name], args.layers)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        model = E.build_kbit(config, dev, 4, fuse_proj=True)
        for ctx in map(int, args.ctx.split(",")):
            for batch in map(int, args.batch.split(",")):
                case = dict(model=name, batch=batch, ctx=ctx, kv_heads=config.num_key_value_heads, head_dim=head_dim)
                for label, fn in (("rule", S.RULE), ("rule w4", rule_w4), ("rule", S.RULE), ("rule w4", rule_w4)):
                    S.timed(rows, args, model, case, label, fn)
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                commit=os.environ.get("KBIT_COMMIT", E.git_commit()), layers=args.layers, steps=args.steps,
                reps=args.reps)
    (out / "attn_warps_ab.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"\n{meta}\nmodel          batch ctx   rule us/layer (2 runs)   rule w4 us/layer (2 runs)")
    keys = dict.fromkeys((r["model"], r["batch"], r["ctx"]) for r in rows)
    for m, b, c in keys:
        us = {lab: [1e3 * r["ms"] / args.layers for r in rows if (r["model"], r["batch"], r["ctx"], r["config"]) ==
                    (m, b, c, lab)] for lab in ("rule", "rule w4")}
        print(f"{m:14s} {b:<5d} {c:<5d} " + "   ".join(" / ".join(f"{u:.2f}" for u in us[lab]) for lab in us))
    return 0


if __name__ == "__main__":
    sys.exit(main())
