"""What kbit's 32-weight scale blocks buy against larger blocks and humming's format, fake-quantized on the CPU.

    PYTHONPATH=src python lab/quality/blocksize_study.py --model smollm2 --k 2,3,4,5 \
        --out benchmarks/results/cpu/quality-blocksize-smollm2-<date>.json

At M = 1 on layers that run at the read ceiling, kbit's time against humming's is the ratio of their bytes
(docs/notes/2026-11-27-k1-split-rule-format-bytes.md): kbit reads an 8-bit log scale per 32 weights (k + 0.25 bits),
humming's ``uint<k>`` a bf16 scale per 128 (k + 0.125). This measures what each costs in quality, per k:

``kbit b32`` / ``b64`` / ``b128``  ``kbit.eval.methods.fake_quant`` at blocksize 32 / 64 / 128 (log8 scales, the
                                   default codebook): k + 0.25 / 0.125 / 0.0625 bits
``uint g128 (humming-like)``       2^k integer levels ``(q - 2^(k-1)) * s`` for q in 0..2^k - 1, one bf16 scale
                                   per 128 weights along K, signed so that the group's largest-magnitude weight
                                   lands on level -2^(k-1) (humming quantizes with negative scales allowed), rounded
                                   to nearest; a plain-torch stand-in, not humming's quantizer: k + 0.125 bits

Every ``nn.Linear`` inside the decoder layers, round-to-nearest (no calibration). Judge, text and metrics as
``lab/quality/rotation_gptq_study.py`` (its ``load`` and ``Judge``): perplexity, KL(ref || quant) per token and
top-1 agreement with the unquantized model over the Lee corpus' first ``--tokens`` tokens.
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

import rotation_gptq_study as study  # this file's folder is on sys.path
import torch
from torch import nn

from kbit.calibrate import decoder_layers
from kbit.eval.judges import lee_text
from kbit.eval.methods import fake_quant


def uint_sym(W: torch.Tensor, k: int, group: int = 128) -> torch.Tensor:
    """Integer levels -2^(k-1)..2^(k-1)-1 times a signed bf16 scale per ``group`` weights along K (K padded): the
    group's largest-magnitude weight maps onto -2^(k-1) exactly, as with a negative scale where it is positive."""
    N, K = W.shape
    Kp = -(-K // group) * group
    Wp = torch.nn.functional.pad(W.float(), (0, Kp - K)).reshape(N, Kp // group, group)
    lo = 2 ** (k - 1)
    peak = Wp.gather(-1, Wp.abs().argmax(-1, keepdim=True))  # signed value of largest magnitude
    s = (peak / -lo).to(torch.bfloat16).float()
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = torch.clamp(torch.round(Wp / s), -lo, lo - 1)
    return (q * s).reshape(N, Kp)[:, :K]


METHODS = {"kbit b32": (lambda W, k: fake_quant(W, k, blocksize=32), 0.25),
           "kbit b64": (lambda W, k: fake_quant(W, k, blocksize=64), 0.125),
           "kbit b128": (lambda W, k: fake_quant(W, k, blocksize=128), 0.0625),
           "uint g128 (humming-like)": (uint_sym, 0.125)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--k", default="2,3,4,5")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.manual_seed(0)
    model, tok = study.load(a.model)
    ids = tok(lee_text(), return_tensors="pt").input_ids[0]
    _, layers = decoder_layers(model)
    targets = {f"{i}.{n}": m for i, layer in enumerate(layers) for n, m in layer.named_modules()
               if isinstance(m, nn.Linear)}
    original = {n: m.weight.detach().clone() for n, m in targets.items()}
    judge = study.Judge(model, ids[:a.tokens], a.window)
    base = judge.baseline()
    print(f"{a.model}: {len(targets)} linears, {judge.windows.numel()} tokens, baseline {base}", flush=True)
    rows = []
    for k in (int(v) for v in a.k.split(",")):
        for name, (fn, extra) in METHODS.items():
            t0 = time.time()
            with torch.no_grad():
                for n, lin in targets.items():
                    lin.weight.copy_(fn(original[n], k))
            s = judge.score()
            rows.append({"k": k, "method": name, "bits": k + extra, **s})
            print(f"k={k} {name:26s} bits {k + extra:.4f} ppl {s['ppl']:10.2f} KL {s['kl']:.4f} "
                  f"top-1 {s['top1']:.3f} ({time.time() - t0:.0f} s)", flush=True)
    with torch.no_grad():
        for n, lin in targets.items():
            lin.weight.copy_(original[n])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"model": a.model, "tokens": int(judge.windows.numel()), "window": a.window, "baseline": base,
           "commit": commit, "date": dt.date.today().isoformat(), "host": platform.node(), "torch": torch.__version__,
           "command": " ".join(sys.argv), "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print("\n| k | method | bits / weight | ppl | KL | top-1 |\n|--:|---|--:|--:|--:|--:|")
    for r in rows:
        print(f"| {r['k']} | {r['method']} | {r['bits']:.4f} | {r['ppl']:.2f} | {r['kl']:.4f} | {r['top1']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
