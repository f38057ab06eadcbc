"""k = 2 through the library's own path: ``kbit.quantize_model(k=2, rotation="hadamard", calibration=ids,
finetune=FinetuneConfig(...))`` on a judge, scored like ``lab/quality/k2_study.py`` (issue 35). For the GPU:

    PYTHONPATH=src python lab/quality/k2_library.py --model smollm2 --steps 0,1000 --device cuda \
        --out benchmarks/results/h100/quality-k2-library-smollm2-<date>.json

Differences from ``k2_study.py`` (a CPU fake-quant study): the real ``KbitLinear`` modules; q/k/v and gate/up
rounded and tuned jointly (one tensor scale and codebook per group, as ``quantize_model`` stores them); GPTQ's
sequential Hessians (``calibrate_layers``) on the same ``--tune-batches`` windows the tuning uses; the model in
``--dtype`` (the unquantized reference in that dtype too). Evaluation: the first ``--tokens`` tokens of the Lee
corpus in ``--window`` windows (disjoint from the windows from ``--tune-offset`` on). ``--tune-ids`` takes the
tuning windows from another text instead (``judge_parts.py --wiki``: gensim's Wikipedia extract, about 1,200
windows), from its ``--tune-offset``. ``--rotation residual`` runs ``quantize_model(rotation="residual")``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

import rotation_gptq_study as study  # this file's folder is on sys.path
import torch

from kbit.calibrate import FinetuneConfig
from kbit.eval.judges import lee_text
from kbit.hf import quantize_model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--steps", default="0,1000", help="tuning steps per row (0: GPTQ only)")
    p.add_argument("--lr-q", type=float, default=FinetuneConfig.lr_q)
    p.add_argument("--lr-codebook", type=float, default=FinetuneConfig.lr_codebook)
    p.add_argument("--lr-norm", type=float, default=FinetuneConfig.lr_norm)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--tune-batches", type=int, default=128)
    p.add_argument("--tune-offset", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1, help="tuning windows a step (a batch of --batch windows)")
    p.add_argument("--ids", type=Path, default=None,
                   help="the Lee corpus as token ids (torch.save of a 1-D tensor), for a machine without the "
                        "tokenizer or gensim (lab/quality/judge_parts.py)")
    p.add_argument("--tune-ids", type=Path, default=None,
                   help="token ids (torch.save of a 1-D tensor) of the tuning text, when it is not the Lee corpus")
    p.add_argument("--extra-ids", type=Path, default=None,
                   help="token ids of a second tuning text: --extra-batches windows of it join the tuning windows")
    p.add_argument("--extra-batches", type=int, default=0)
    p.add_argument("--rotation", default="hadamard", choices=("hadamard", "residual"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    dtype = getattr(torch, a.dtype)
    model, tok = study.load(a.model, tokenizer=a.ids is None)
    ids = tok(lee_text(), return_tensors="pt").input_ids[0] if a.ids is None else torch.load(a.ids).long()
    text = ids if a.tune_ids is None else torch.load(a.tune_ids).long()
    tune = [text[a.tune_offset + i * a.window:a.tune_offset + (i + 1) * a.window][None] for i in range(a.tune_batches)]
    if tune[-1].numel() < a.window or (a.tune_ids is None and a.tune_offset < a.tokens):
        raise SystemExit(f"text has {ids.numel()} tokens: evaluation and tuning ranges do not fit apart")
    if a.extra_ids is not None:  # more windows from a second text, shuffled in with a fixed seed
        extra = torch.load(a.extra_ids).long()
        tune += [extra[i * a.window:(i + 1) * a.window][None] for i in range(a.extra_batches)]
        if tune[-1].numel() < a.window:
            raise SystemExit(f"{a.extra_ids}: {extra.numel()} tokens, fewer than --extra-batches windows")
        order = torch.randperm(len(tune), generator=torch.Generator().manual_seed(0)).tolist()
        tune = [tune[i] for i in order]
    tune = [torch.cat(tune[i:i + a.batch]) for i in range(0, len(tune) - a.batch + 1, a.batch)]
    judge = study.Judge(model.to(a.device, dtype), ids[:a.tokens].to(a.device), a.window)
    base = judge.baseline()
    print(f"{a.model}: baseline {base}, {time.perf_counter() - t0:.0f}s", flush=True)
    rows = []
    for steps in [int(s) for s in a.steps.split(",")]:
        t = time.perf_counter()
        model = study.load(a.model, tokenizer=False)[0].to(a.device, dtype)
        cfg = FinetuneConfig(steps=steps, lr_q=a.lr_q, lr_codebook=a.lr_codebook, lr_norm=a.lr_norm, warmup=a.warmup)
        quantize_model(model, k=a.k, rotation=a.rotation, calibration=tune, finetune=cfg if steps else None)
        if a.device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        judge.model = model
        m = judge.score()
        method = ("rot+gptq" if a.rotation == "hadamard" else "residual+gptq") + (
            f"+tune{steps}/{len(tune)}x{a.batch}w" if steps else "")
        rows.append({"k": a.k, "method": method,
                     "bits": a.k + 0.25, **m, "ppl_ratio": m["ppl"] / base["ppl"],
                     "quantize_seconds": round(seconds, 1)})
        print(json.dumps(rows[-1]), flush=True)
        del model
        if a.out is not None:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps({
                "model": a.model, "date": dt.date.today().isoformat(), "commit": study.commit(),
                "command": "PYTHONPATH=src python lab/quality/k2_library.py " + " ".join(argv or sys.argv[1:]),
                "torch": torch.__version__, "machine": platform.machine(),
                "device": torch.cuda.get_device_name() if a.device == "cuda" else a.device, "dtype": a.dtype,
                "eval_tokens": judge.windows.numel(), "tune_tokens": len(tune) * a.batch * a.window,
                "batch": a.batch,
                "tune_offset": a.tune_offset,
                "tune_text": "lee" if a.tune_ids is None else a.tune_ids.name,
                "extra_text": None if a.extra_ids is None else [a.extra_ids.name, a.extra_batches],
                "rotation": a.rotation,
                "lr_q": a.lr_q, "lr_codebook": a.lr_codebook, "lr_norm": a.lr_norm,
                "warmup": a.warmup, "baseline": base, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
