"""k = 2 made usable? rot+gptq, then end-to-end tuning of the format's continuous parameters (issue 35).

    PYTHONPATH=src python lab/quality/k2_study.py --model smollm2 --steps 0,160 \
        --out benchmarks/results/cpu/quality-k2-smollm2-<date>.json

Same judges, text, evaluation and metrics as ``lab/quality/rotation_gptq_study.py`` (its ``load``, ``Judge`` and
``collect_hessians`` are imported from that file). Every decoder ``nn.Linear`` is rounded by
``kbit.calibrate.gptq_quantize(W, H, k, rotation="hadamard")`` on Hessians of the unquantized model (one pass,
``--calib-batches`` windows of ``--calib-len`` tokens from token ``--calib-offset``), and kept as a
``KbitWeight``; the model runs its fake-quantized weight ``unrotate(dequantize(qw))``.

Then ``kbit.calibrate.finetune`` tunes, with the codes fixed, each tensor's codebook, its log8 block scales
(straight-through rounding) and the model's norm gains, minimising the KL to the unquantized model's top-``--top``
log-probabilities on ``--tune-batches`` windows from ``--calib-offset`` on (the Hessian windows and the ones after
them; all disjoint from the evaluation text). ``--steps 0,N`` measures the untuned rounding and N steps (one
window per step). The format is unchanged: k + 0.25 bits per weight.
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

from kbit.calibrate import (
    FinetuneConfig,
    calibrate_layers,
    decoder_linear_names,
    finetune,
    gptq_quantize,
    teacher_targets,
)
from kbit.eval.judges import lee_text
from kbit.format.codebooks import DEFAULT_CODEBOOK
from kbit.format.reference import dequantize_reference
from kbit.ops.quantize import unrotate_weight

CACHE = Path("/tmp/kbit-k2")


def sequential(model, names, calib, a) -> dict:
    """name -> KbitWeight from rot+gptq layer by layer (``kbit.calibrate.calibrate_layers``): each layer's
    Hessians from what its fake-quantized predecessors produce; the model's weights are restored after."""
    original = {n: model.get_submodule(n).weight.data.clone() for n in names}
    out = {}

    def fake_quant(name, linear, H):
        qw = gptq_quantize(linear.weight.data, H, k=a.k, codebook=DEFAULT_CODEBOOK[a.k], damp=a.damp,
                           rotation="hadamard")
        out[name] = qw
        install(model, {name: qw})
        return None

    calibrate_layers(model, calib, fake_quant)
    for n in names:
        model.get_submodule(n).weight.data = original[n]
    return out


def rounded(model, names, calib, a, study) -> dict:
    """name -> KbitWeight from rot+gptq; each projection of all layers as one stack, or ``--sequential`` (cached
    under /tmp)."""
    seq = "-seq" if a.sequential else ""
    path = CACHE / f"{a.model}-k{a.k}-damp{a.damp}-c{len(calib)}x{a.calib_len}-{a.calib_offset}{seq}.pt"
    if path.exists():
        return torch.load(path, weights_only=False)
    if a.sequential:
        out = sequential(model, names, calib, a)
        CACHE.mkdir(parents=True, exist_ok=True)
        torch.save(out, path)
        return out
    mods = {n: model.get_submodule(n) for n in names}
    hessians = study.collect_hessians(model, mods, calib)
    groups: dict = {}
    for n in names:
        groups.setdefault(n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1], []).append(n)
    out = {}
    for group in groups.values():
        K = mods[group[0]].in_features
        chunk = max(1, int(2 * 2**30) // (4 * 8 * K * K))
        for i in range(0, len(group), chunk):
            part = group[i:i + chunk]
            W = torch.stack([mods[n].weight.data for n in part])
            H = torch.stack([hessians[n] for n in part])
            qw = gptq_quantize(W, H, k=a.k, codebook=DEFAULT_CODEBOOK[a.k], damp=a.damp, rotation="hadamard")
            out.update({n: qw[j] for j, n in enumerate(part)})
    CACHE.mkdir(parents=True, exist_ok=True)
    torch.save(out, path)
    return out


def install(model, weights: dict) -> None:
    for n, qw in weights.items():
        w = dequantize_reference(qw)
        model.get_submodule(n).weight.data = unrotate_weight(w, qw.rotation) if qw.rotation is not None else w


def _label(run: dict, row: dict) -> str:
    """The row's method, with its learning rates where it was tuned."""
    lrs = [f"{key} {run[key]:g}" for key in ("lr_q", "lr_codebook", "lr_norm") if key in run]
    return row["method"] + (f" ({', '.join(lrs)})" if lrs and "tune" in row["method"] else "")


def table(results: list[dict]) -> str:
    """Markdown rows of every results file: the k = 2 bar is top-1 >= 0.6 and ppl <= 3x unquantized. The train
    KL is per pass over the tuning windows, or per 16 steps where a row has ``train_kl_per_16_steps``."""
    lines = ["| judge | method | bits/weight | ppl | ppl / unquantized | KL | top-1 | bar met | train KL |"
             " seconds |", "|---|---|--:|--:|--:|--:|--:|---|---|--:|"]
    for r in results:
        if not r["rows"]:  # a run stopped before its first row (its "stopped" says why)
            continue
        base = r["baseline"]
        lines.append(f"| {r['model']} | unquantized | 32 | {base['ppl']:.2f} | 1 | 0 | 1 | | | |")
        for row in r["rows"]:
            met = "yes" if row["top1"] >= 0.6 and row["ppl_ratio"] <= 3 else "no"
            trace = row.get("train_kl_per_16_steps", row["train_kl_per_epoch"])
            epochs = ", ".join(f"{v:.3f}" for v in trace) + (" (per 16 steps)" if "train_kl_per_16_steps" in row
                                                             and trace else "")
            lines.append(f"| {r['model']} | {_label(r, row)} | {row['bits']} | {row['ppl']:.2f} | "
                         f"{row['ppl_ratio']:.2f}x | {row['kl']:.4f} | {row['top1']:.4f} | {met} | {epochs} | "
                         f"{row['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--damp", type=float, default=0.1)
    p.add_argument("--steps", default="0,160", help="tuning steps per row (0: rot+gptq untuned)")
    p.add_argument("--lr-q", type=float, default=FinetuneConfig.lr_q)
    p.add_argument("--lr-codebook", type=float, default=FinetuneConfig.lr_codebook)
    p.add_argument("--lr-norm", type=float, default=FinetuneConfig.lr_norm)
    p.add_argument("--lr-codes", type=float, default=0.0, help="> 0: free codes (latent values, straight-through)")
    p.add_argument("--no-norms", action="store_true")
    p.add_argument("--warmup", type=int, default=0, help="steps of linear learning-rate warmup")
    p.add_argument("--sequential", action="store_true",
                   help="GPTQ layer by layer on the fake-quantized predecessors' outputs (default: one pass)")
    p.add_argument("--top", type=int, default=128)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--calib-batches", type=int, default=16)
    p.add_argument("--tune-batches", type=int, default=32)
    p.add_argument("--calib-len", type=int, default=512)
    p.add_argument("--calib-offset", type=int, default=40000)
    p.add_argument("--tune-offset", type=int, default=None,
                   help="first token of the tuning windows (default: --calib-offset)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--table", type=Path, nargs="+", default=None,
                   help="print the markdown table of these results files and exit")
    a = p.parse_args(argv)
    if a.table:
        runs = [json.loads(f.read_text()) for f in a.table]  # a run, or a judge's file {"runs": [...]}
        print(table([r for d in runs for r in d.get("runs", [d])]), end="")
        return 0
    torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    commit = study.commit()  # the code that runs, not what is committed while it runs
    model, tok = study.load(a.model)
    ids = tok(lee_text(), return_tensors="pt").input_ids[0]
    tune_offset = a.calib_offset if a.tune_offset is None else a.tune_offset
    windows = [ids[a.calib_offset + i * a.calib_len:a.calib_offset + (i + 1) * a.calib_len][None]
               for i in range(a.calib_batches)]
    tune = [ids[tune_offset + i * a.calib_len:tune_offset + (i + 1) * a.calib_len][None]
            for i in range(a.tune_batches)]
    if windows[-1].numel() < a.calib_len or tune[-1].numel() < a.calib_len or min(a.calib_offset,
                                                                                  tune_offset) < a.tokens:
        raise SystemExit(f"text has {ids.numel()} tokens: evaluation and calibration ranges do not fit apart")
    judge = study.Judge(model, ids[:a.tokens], a.window)
    base = judge.baseline()
    names = decoder_linear_names(model)
    original = {n: model.get_submodule(n).weight.data.clone() for n in names}
    path = CACHE / f"{a.model}-teacher-top{a.top}-{len(tune)}x{a.calib_len}-{tune_offset}.pt"
    if path.exists():  # the unquantized model's targets: minutes on one core for 128 windows
        teacher = torch.load(path, weights_only=False)
    else:
        teacher = teacher_targets(model, tune, top=a.top)
        CACHE.mkdir(parents=True, exist_ok=True)
        torch.save(teacher, path)
    qws = rounded(model, names, windows, a, study)
    print(f"{a.model}: {len(names)} linears, baseline {base}, {time.perf_counter() - t0:.0f}s", flush=True)
    rows = []
    for steps in [int(s) for s in a.steps.split(",")]:
        t = time.perf_counter()
        cfg = FinetuneConfig(steps=steps, lr_q=a.lr_q, lr_codebook=a.lr_codebook, lr_norm=a.lr_norm,
                             norms=not a.no_norms, lr_codes=a.lr_codes, warmup=a.warmup)
        norms = {n: p.data.clone() for n, p in model.named_parameters() if p.dim() == 1}
        trace: list[float] = []

        def log(step, loss, tr=trace, t=t):
            tr.append(loss)
            if (step + 1) % 16 == 0:
                print(f"step {step + 1}: mean KL of the last 16 {sum(tr[-16:]) / 16:.4f}, "
                      f"{time.perf_counter() - t:.0f}s", flush=True)

        tuned = finetune(model, qws, tune, teacher, cfg, log=log) if steps else qws
        install(model, tuned)
        m = judge.score()
        for n in names:
            model.get_submodule(n).weight.data = original[n].clone()
        for n, p in model.named_parameters():
            if n in norms:
                p.data.copy_(norms[n])
        per_epoch = [round(sum(trace[i:i + len(tune)]) / len(trace[i:i + len(tune)]), 4)
                     for i in range(0, len(trace), len(tune))]
        method = ("rot+seqgptq" if a.sequential else "rot+gptq") + (
            f"+tune{steps}/{len(tune)}w" + (f"+codes{a.lr_codes:g}" if a.lr_codes > 0 else "")
            + (f"+warmup{a.warmup}" if a.warmup else "") if steps else "")
        rows.append({"k": a.k, "method": method, "bits": a.k + 0.25,
                     **m, "ppl_ratio": m["ppl"] / base["ppl"], "train_kl_per_epoch": per_epoch,
                     "seconds": round(time.perf_counter() - t, 1)})
        print(json.dumps(rows[-1]), flush=True)
        if a.out is not None:
            result = {"model": a.model, "date": dt.date.today().isoformat(), "commit": commit,
                      "command": "PYTHONPATH=src python lab/quality/k2_study.py " + " ".join(argv or sys.argv[1:]),
                      "torch": torch.__version__, "machine": platform.machine(), "eval_tokens": judge.windows.numel(),
                      "calib_tokens": a.calib_batches * a.calib_len, "tune_tokens": a.tune_batches * a.calib_len,
                      "calib_offset": a.calib_offset, "tune_offset": tune_offset,
                      "text": "gensim test_data/lee_background.cor",
                      "damp": a.damp, "top": a.top, "lr_q": a.lr_q, "lr_codebook": a.lr_codebook,
                      "lr_norm": a.lr_norm, "lr_codes": a.lr_codes, "norms": not a.no_norms,
                      "warmup": a.warmup, "sequential": a.sequential,
                      "quantized_linears": len(names),
                      "baseline": base, "rows": rows, "seconds": round(time.perf_counter() - t0, 1)}
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
