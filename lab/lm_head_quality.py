"""What a k-bit lm_head costs in quality (issue 36, item 3), fake-quantized on the CPU.

    PYTHONPATH=src python lab/lm_head_quality.py --model smollm2 --k 3,4,5 --tokens 2048 \
        --out benchmarks/results/cpu/lm-head-quality-smollm2-<date>.json

Rows, each against the unquantized model (perplexity, mean KL(ref || quant) per token, top-1 agreement):
``head k``: only the output head at k bits (kbit's default codebook, blocksize 32; a tied embedding stays float,
as ``KbitConfig(quantize_lm_head=True)`` unties it); ``decoder 4``: every decoder Linear at k = 4 (the default
model of kbit); ``decoder 4 + head k``: both, so the head's share of the loss is the difference of the two.
Judges, text and metrics are those of ``lab/quality/rotation_gptq_study.py``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent / "quality"))
from rotation_gptq_study import Judge, load  # noqa: E402  (the study's judges, text windows and scores)

from kbit.calibrate import decoder_layers  # noqa: E402
from kbit.eval.judges import lee_text  # noqa: E402
from kbit.eval.methods import fake_quant  # noqa: E402


def decoder_linears(model) -> list[nn.Linear]:
    _, layers = decoder_layers(model)
    return [m for m in layers.modules() if isinstance(m, nn.Linear)]


def run(model, judge: Judge, k_head: int | None, decoder_k: int | None) -> dict:
    """Score with the head at ``k_head`` bits and the decoder at ``decoder_k`` (None: float), then restore."""
    saved = {}
    if decoder_k is not None:
        for m in decoder_linears(model):
            saved[m] = m.weight.data
            m.weight.data = fake_quant(m.weight.data, decoder_k)
    head = model.get_output_embeddings()
    head_weight = head.weight
    if k_head is not None:  # a separate Parameter: the tied input embedding keeps the float weight
        head.weight = nn.Parameter(fake_quant(head_weight.data, k_head), requires_grad=False)
    try:
        return judge.score()
    finally:
        head.weight = head_weight
        for m, w in saved.items():
            m.weight.data = w


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--k", default="3,4,5")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load(a.model)
    ids = torch.tensor(tok(lee_text())["input_ids"][: a.tokens])
    judge = Judge(model, ids, a.window)
    rows = [dict(variant="unquantized", **judge.baseline())]
    variants = [(f"head {k}", k, None) for k in map(int, a.k.split(","))]
    variants += [("decoder 4", None, 4)] + [(f"decoder 4 + head {k}", k, 4) for k in map(int, a.k.split(","))]
    for name, kh, kd in variants:
        start = time.perf_counter()
        rows.append(dict(variant=name, **run(model, judge, kh, kd), seconds=round(time.perf_counter() - start, 1)))
        print(f"{name:<22} ppl {rows[-1]['ppl']:9.3f}  KL {rows[-1]['kl']:.4f}  top-1 {rows[-1]['top1']:.3f}",
              flush=True)
    head = model.get_output_embeddings().weight
    meta = dict(model=a.model, head_shape=list(head.shape), tokens=judge.windows.numel(), window=a.window,
                date=dt.date.today().isoformat(), machine=platform.processor() or platform.machine(),
                torch=torch.__version__,
                commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                      text=True).stdout.strip(),
                command=" ".join(sys.argv))
    if a.out:
        Path(a.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
