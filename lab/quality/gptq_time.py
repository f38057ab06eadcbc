"""How long ``quantize_model(..., calibration=...)`` (GPTQ layer by layer) takes on a Llama-3-8B-shaped model on
one GPU (issue 35 asks for the time of an 8B model on the H100). The weights are random (the rounding's cost does
not depend on their values) and so is the calibration text: ``--windows`` windows of ``--seq`` token ids, the
defaults those of calibration text (``kbit.hf.calibration.BATCHES`` x ``SEQ_LEN``).

    PYTHONPATH=src python lab/quality/gptq_time.py --k 3 --rotation hadamard --out $OUT/gptq-time.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kbit.hf import quantize_model
from kbit.hf.calibration import BATCHES, SEQ_LEN

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                 tie_word_embeddings=False)


def main(argv=None) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--rotation", default="hadamard", choices=("none", "hadamard", "residual"))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--windows", type=int, default=BATCHES)
    p.add_argument("--seq", type=int, default=SEQ_LEN)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    cfg = LlamaConfig(**(LLAMA3_8B | {"num_hidden_layers": a.layers}))
    t = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    params = sum(q.numel() for q in model.parameters())
    print(f"model: {params / 1e9:.2f}B parameters, built in {time.perf_counter() - t:.1f}s", flush=True)
    ids = [torch.randint(0, cfg.vocab_size, (1, a.seq), device="cuda") for _ in range(a.windows)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    quantize_model(model, k=a.k, rotation=None if a.rotation == "none" else a.rotation, calibration=ids,
                   progress=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    row = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "params": params, "layers": a.layers,
           "k": a.k, "rotation": a.rotation, "calibration_tokens": a.windows * a.seq, "seconds": round(seconds, 1),
           "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
           "command": "PYTHONPATH=src python lab/quality/gptq_time.py " + " ".join(argv or sys.argv[1:])}
    print(json.dumps(row), flush=True)
    if a.out is not None:
        a.out.write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
