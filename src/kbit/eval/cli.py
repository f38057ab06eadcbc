"""``kbit eval``: quality of kbit codebooks against RTN and NF4-style baselines on two offline judges.

    kbit eval --model minilm --k 2,3,4,5 --sentences 400 --out benchmarks/results/cpu
    kbit eval --model smollm2 --tokens 2048 --out benchmarks/results/cpu
    kbit eval --table benchmarks/results/cpu/quality-minilm-2026-11-21.json
    kbit eval --quick                  # both judges, k = 4, default codebook and baselines (< 5 min, 2 cores)
    kbit eval --model smollm2 --k 2,3,4 --calibrate   # + kbit/calibrated: GPTQ and the measured rotation

Results are written after each row (``--out``, default ``kbit-eval/``), so a stopped run keeps what it
measured; each row prints its progress. The metrics are explained in docs/eval.md. Every row costs
``k + 0.25`` bits per weight (``kbit.eval.methods``). Needs ``pip install 'kbit[eval]'``;
runs on the CPU (fake-quantized float32 weights: the numbers of KbitLinear's CPU path). ``--calibrate`` adds, for
the causal-LM judge, the row ``kbit/calibrated`` per k: ``kbit.quantize_model(rotation="auto", calibration=...)``
on a copy of the float model (the second half of the Lee corpus as calibration text, disjoint from the evaluation
text at the start of it; real k-bit modules).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from pathlib import Path

import torch

from kbit.bench.args import bits_list, positive_int
from kbit.eval.judges import JUDGES, run
from kbit.eval.methods import calibrated, methods
from kbit.format.codebooks import DEFAULT_CODEBOOK, NAMED
from kbit.hf.calibration import default_calibration_text

#: ``--quick``: both judges on less text, k = 4 only, the default codebook and the two baselines.
QUICK = {"model": ["minilm", "smollm2"], "k": [4], "codebooks": [DEFAULT_CODEBOOK[4]], "sentences": 100,
         "tokens": 512}

METRICS = {
    "minilm": (("loss", "mean 1-cos", "{:.5f}"), ("cos_p1", "p1 cos", "{:.4f}")),
    "smollm2": (("ppl", "perplexity", "{:.3f}"), ("kl", "KL (nats/token)", "{:.4f}"), ("top1", "top-1 agree",
                                                                                          "{:.3f}")),
}
#: The issue's bar (MiniLM): the default loses no more than NF and than RTN at every k, and >= 20% less
#: than NF at k = 2, 3.
BAR_MARGIN = {2: 0.8, 3: 0.8, 4: 1.0, 5: 1.0}


def _list(cast):
    def parse(text: str):
        try:
            return [cast(v.strip()) for v in text.split(",") if v.strip()]
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"expected a comma list, got {text!r}") from e
    return parse


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=_list(str), default="minilm", help="minilm, smollm2 or both (comma list)")
    p.add_argument("--k", type=bits_list, default="2,3,4,5", help="bits (default 2,3,4,5)")
    p.add_argument("--codebooks", type=_list(str), default=",".join(NAMED), help=f"default {','.join(NAMED)}")
    p.add_argument("--no-baselines", action="store_true", help="skip rtn-g128 and nf-b64")
    p.add_argument("--sentences", type=positive_int, default=400, help="MiniLM: sentences (default 400)")
    p.add_argument("--tokens", type=positive_int, default=2048, help="SmolLM2: tokens of text (default 2048)")
    p.add_argument("--window", type=positive_int, default=512, help="SmolLM2: tokens per forward pass (default 512)")
    p.add_argument("--out", type=Path, default=Path("kbit-eval"),
                   help="folder for the JSON results, written after each row (default: kbit-eval/)")
    p.add_argument("--calibrate", action="store_true",
                   help="also kbit/calibrated per k (GPTQ on the Lee corpus' second half with the rotation "
                        "quantize_model(rotation='auto') picks; causal-LM judge only, minutes per k)")
    p.add_argument("--quick", action="store_true",
                   help="both judges, k=4, default codebook + baselines, 100 sentences / 512 tokens (< 5 min)")
    p.add_argument("--table", type=Path, default=None, help="render a results JSON as markdown and exit")


def main(args) -> int:
    if args.table is not None:
        if not args.table.is_file():
            raise ValueError(f"--table: expected a results JSON file, got '{args.table}' (not found)")
        try:
            results = json.loads(args.table.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--table: expected a results JSON file, got unreadable JSON in '{args.table}' ({e})") \
                from e
        print(render(results))
        return 0
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    for name in args.model:
        if name not in JUDGES:
            raise ValueError(f"--model: expected one of {sorted(JUDGES)}, got {name!r}")
    for cb in args.codebooks:
        if cb not in NAMED:
            raise ValueError(f"--codebooks: expected names from {list(NAMED)}, got {cb!r}")
    start = time.perf_counter()
    for name in args.model:
        evaluate_row(name, args, start)
    return 0


def evaluate_row(name: str, args, start: float) -> dict:
    """Run judge ``name`` over every (k, method), saving the results file after each row."""
    kw = {"n": args.sentences} if name == "minilm" else {"tokens": args.tokens, "window": min(args.window,
                                                                                              args.tokens)}
    print(f"[{time.perf_counter() - start:5.0f} s] {name}: loading the model and the unquantized reference",
          flush=True)
    judge = JUDGES[name](**kw)
    plan = [(k, methods(k, args.codebooks, baselines=not args.no_baselines)) for k in args.k]
    if args.calibrate and hasattr(judge, "score_model"):
        text = default_calibration_text()
        plan = [(k, [*ms, calibrated(k, text, judge.tok)]) for k, ms in plan]
    elif args.calibrate:
        print(f"{name}: --calibrate applies to causal-LM judges only; no kbit/calibrated rows", flush=True)
    total, done = sum(len(ms) for _, ms in plan), []
    result = {"judge": name, **judge.info, "date": dt.date.today().isoformat(),
              "torch": torch.__version__, "machine": platform.machine(),
              "default_codebook": {str(k): v for k, v in DEFAULT_CODEBOOK.items()},
              "baseline": judge.baseline() if hasattr(judge, "baseline") else None, "rows": done}
    path = args.out / f"quality-{name}-{result['date']}{'-quick' if args.quick else ''}.json"
    args.out.mkdir(parents=True, exist_ok=True)

    def save(rows_of_k):
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**result, "rows": done + rows_of_k}, indent=1) + "\n")
        tmp.replace(path)  # a stopped run never leaves a half-written file

    count = [0]

    def log(line):
        count[0] += 1
        print(f"[{time.perf_counter() - start:5.0f} s] {count[0]}/{total} {line}", flush=True)

    for _, ms in plan:
        done.extend(run(judge, ms, log=log, on_row=save))
    save([])
    print(f"wrote {path}")
    print(render({**result, "rows": done}))
    return result


def render(result: dict) -> str:
    """Markdown: one row per (k, method), the default codebook marked; for MiniLM the issue's bar per k."""
    judge = result["judge"]
    metrics = METRICS[judge]
    defaults = {int(k): v for k, v in result.get("default_codebook", {}).items()}
    head = "| k | method | bits/weight | " + " | ".join(m[1] for m in metrics) + " |"
    lines = [head, "|" + "---|" * (3 + len(metrics))]
    if result.get("baseline"):
        base = result["baseline"]
        lines.append("| - | unquantized | 32 | " + " | ".join(fmt.format(base[key]) for key, _, fmt in metrics)
                     + " |")
    for r in result["rows"]:
        label = r["method"] + (" (default)" if r["method"] == f"kbit/{defaults.get(r['k'])}" else "")
        lines.append(f"| {r['k']} | {label} | {r['bits']:.2f} | "
                     + " | ".join(fmt.format(r[key]) for key, _, fmt in metrics) + " |")
    out = "\n".join(lines)
    if judge == "minilm" and defaults:
        out += "\n\n" + "\n".join(verdict(result))
    return out


def verdict(result: dict) -> list[str]:
    """Per k: the best codebook, and whether the default meets the bar (loss = mean 1-cos)."""
    defaults = {int(k): v for k, v in result["default_codebook"].items()}
    by = {(r["k"], r["method"]): r["loss"] for r in result["rows"]}
    lines = []
    for k in sorted({r["k"] for r in result["rows"]}):
        kb = {m: v for (kk, m), v in by.items() if kk == k and m.startswith("kbit/")}
        if not kb:
            continue
        best = min(kb, key=kb.get)
        d = by.get((k, f"kbit/{defaults[k]}"))
        nf, rtn, nfb = by.get((k, "kbit/nf")), by.get((k, "rtn-g128")), by.get((k, "nf-b64"))
        parts = [f"- k={k}: best {best} ({kb[best]:.5f}); default kbit/{defaults[k]} {d:.5f}"]
        ok = True
        for label, ref, margin in (("kbit/nf", nf, BAR_MARGIN[k]), ("nf-b64", nfb, BAR_MARGIN[k]),
                                   ("rtn-g128", rtn, 1.0)):
            if ref is None or d is None:
                continue
            good = d <= margin * ref
            ok &= good
            parts.append(f"{d / ref:.2f}x {label}" + ("" if good else f" (bar {margin:.1f}x: FAIL)"))
        lines.append(", ".join(parts) + (" -> meets the bar" if ok else " -> misses the bar"))
    return lines
