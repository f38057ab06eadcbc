"""Does rotating the residual stream (kbit.calibrate.residual.rotate_residual) make k-bit rounding lose less? CPU.

    OMP_NUM_THREADS=1 PYTHONPATH=src nice python lab/quality/residual_rotation_check.py --k 3,4 --tokens 2048 \
        --gptq --threads 1 --out benchmarks/results/cpu/residual-rotation-smollm2-<date>.json

SmolLM2-135M-Instruct (kbit.hf.generate.load_default_model, float32), every decoder Linear fake-quantized
(kbit's default codebook at k, blocksize 32; embeddings and lm_head float), scored against the unquantized,
unrotated model over the first ``--tokens`` tokens of kbit.eval.judges.lee_text() in windows of ``--window``
(perplexity, mean KL(ref || variant) per token, top-1 agreement: the scorer of rotation_gptq_study.py). Rows
(``<prep> + <rounding> k``):

- prep ``plain``: the model as shipped; ``online rot``: every Linear quantized as ``W R_K`` with ``x R_K`` made
  online (the study's ``rot``, simulated as ``Q(W R) R^T``); ``residual``: rotate_residual (seed s): q/k/v,
  gate/up, o_proj rotated offline, down_proj not; ``residual + down online``: as ``residual`` and down_proj's
  input rotated too (what the fused silu_mul kernel could do online), simulated the same way;
- rounding ``rtn`` (kbit.eval.methods.fake_quant) or, with ``--gptq``, ``gptq`` (the study's one-pass GPTQ with
  Hessians of the prepared float model on ``--calib-batches`` x 512 tokens from token 40000 of the same text);
- diagnostics (``--preps fold,fold + online rot``): the norms folded as rotate_residual does, no residual R;
- ``residual float``: rotate_residual alone (KL ~ 0: the float function is unchanged);
- ``--kinds hadamard,orthogonal``: the residual rows for each kind of R (``residual (orthogonal)``: a dense random
  orthogonal R mixing all H channels; the Hadamard mixes blocks of the largest power of two dividing H, 64 here).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from rotation_gptq_study import Judge, apply, collect_hessians, load  # this file's folder is on sys.path
from torch import nn

from kbit.calibrate.residual import rotate_residual
from kbit.eval.judges import lee_text
from kbit.format.codebooks import DEFAULT_CODEBOOK
from kbit.hf.generate import load_default_model

PREPS = ("plain", "online rot", "residual", "residual + down online")
FOLD_PREPS = ("fold", "fold + online rot")  # diagnostics (--preps): the norm folding alone, no residual R


@torch.no_grad()
def fold_norms(model) -> None:
    """Fold every decoder RMSNorm weight into the Linears reading its output and set it to one (Llama layout):
    rotate_residual's first step without its rotation."""
    for layer in model.model.layers:
        for norm, readers in ((layer.input_layernorm, ("q_proj", "k_proj", "v_proj")),
                              (layer.post_attention_layernorm, ("gate_proj", "up_proj"))):
            for r in readers:
                block = layer.self_attn if r in ("q_proj", "k_proj", "v_proj") else layer.mlp
                getattr(block, r).weight.mul_(norm.weight)
            norm.weight.fill_(1.0)


def targets_of(model) -> dict[str, nn.Linear]:
    return {f"{i}.{n}": m for i, layer in enumerate(model.model.layers) for n, m in layer.named_modules()
            if isinstance(m, nn.Linear)}


@torch.no_grad()
def variant(base, prep: str, rounding: str | None, k: int, seed: int, kind: str, calib, a
            ) -> tuple[nn.Module, dict]:
    """A quantized copy of ``base``: ``prep`` (PREPS; ``kind`` of the residual R), then ``rounding`` (None:
    float) of every decoder Linear."""
    model = copy.deepcopy(base)
    info = {}
    if prep.startswith("residual"):
        report = rotate_residual(model, seed=seed, kind=kind)
        info = dict(block=report.block, head_block=report.head_block, untied_bytes=report.untied_bytes,
                    incoherence_before=round(report.incoherence_before, 4),
                    incoherence_after=round(report.incoherence_after, 4))
    elif prep.startswith("fold"):
        fold_norms(model)
    if rounding is None:
        return model.eval(), info
    targets = targets_of(model)
    hessians = collect_hessians(model, targets, calib) if rounding == "gptq" else None
    online = {n for n in targets if prep.endswith("online rot") or (prep.endswith("down online") and "down_proj" in n)}
    for rotated in (False, True):  # the study's methods: rtn, rot, gptq, rot+gptq
        part = {n: m for n, m in targets.items() if (n in online) == rotated}
        method = ("rot+gptq" if rotated else "gptq") if rounding == "gptq" else ("rot" if rotated else "rtn")
        if part:
            apply(model, part, method, k, DEFAULT_CODEBOOK[k], calib, hessians, a)
    return model.eval(), info


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--k", default="3,4")
    p.add_argument("--seeds", default="0", help="rotation seeds (comma separated)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--gptq", action="store_true", help="also the GPTQ rows (minutes each on the CPU)")
    p.add_argument("--preps", default=",".join(PREPS))
    p.add_argument("--kinds", default="hadamard", help="kinds of the residual R (kbit.calibrate.residual.KINDS)")
    p.add_argument("--calib-batches", type=int, default=8)
    p.add_argument("--roundings", default=None, help="rtn,gptq (default: rtn, and gptq with --gptq)")
    p.add_argument("--model", default="smollm2", help="smollm2 (kbit's default model) or a judge of "
                   "rotation_gptq_study.py (e.g. qwen25coder)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    a.sequential, a.scales, a.damp = False, "updated", 0.1  # the study's GPTQ defaults
    base, tok = load_default_model(torch.float32) if a.model == "smollm2" else load(a.model)
    ids = tok(lee_text(), return_tensors="pt").input_ids[0]
    calib = [ids[40000 + i * 512:40000 + (i + 1) * 512][None] for i in range(a.calib_batches)]
    judge = Judge(base, ids[: a.tokens], a.window)
    seeds = [int(s) for s in a.seeds.split(",")]
    kinds, preps = a.kinds.split(","), a.preps.split(",")
    if set(preps) - set(PREPS + FOLD_PREPS):
        p.error(f"--preps: expected some of {PREPS + FOLD_PREPS}, got {preps}")
    runs = [(prep, kind, s) for prep in preps for kind in (kinds if "residual" in prep else ["-"])
            for s in (seeds if "residual" in prep else [0])]
    plan = [("residual", None, 0, kind, s) for kind in kinds for s in seeds]
    for k in map(int, a.k.split(",")):
        roundings = a.roundings.split(",") if a.roundings else ("rtn", "gptq") if a.gptq else ("rtn",)
        for rounding in roundings:
            plan += [(prep, rounding, k, kind, s) for prep, kind, s in runs]
    rows = [dict(variant="unquantized", **judge.baseline())]
    for prep, rounding, k, kind, seed in plan:
        start = time.perf_counter()
        judge.model, info = variant(base, prep, rounding, k, seed, kind, calib, a)
        label = prep if kind in ("-", "hadamard") else prep.replace("residual", f"residual ({kind})")
        name = f"{label} + {rounding} {k}" if rounding else f"{label} float"
        row = dict(variant=name, k=k if rounding else None, seed=seed if "residual" in prep else None,
                   **judge.score(), **info)
        rows.append(dict(row, seconds=round(time.perf_counter() - start, 1)))
        print(f"{name:<36} seed {seed}  ppl {row['ppl']:9.3f}  KL {row['kl']:.4f}  top-1 {row['top1']:.3f}  "
              f"{rows[-1]['seconds']}s", flush=True)
    gptq = "gptq" in str(a.roundings) or a.gptq
    meta = dict(model="SmolLM2-135M-Instruct" if a.model == "smollm2" else a.model, tokens=judge.windows.numel(),
                window=a.window, calib_tokens=len(calib) * 512 if gptq else 0,
                text="gensim test_data/lee_background.cor",
                date=dt.date.today().isoformat(), machine=platform.processor() or platform.machine(),
                torch=torch.__version__, threads=torch.get_num_threads(),
                commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                      text=True).stdout.strip(),
                command=" ".join(sys.argv))
    if a.out:
        Path(a.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
