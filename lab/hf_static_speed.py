"""Decode speed of transformers' own ``generate`` (static cache, optionally torch.compile) on a kbit-quantized
model next to kbit's :class:`~kbit.hf.decode.StaticDecoder` (every step one CUDA graph), batch 1, greedy (issue 33).

A Llama-3-8B-shaped model with fewer layers (random weights; the decode step's shapes are the real ones), bf16,
quantized with ``kbit.quantize_model`` at k = 4. Prints tokens/s of each and the ratio. Needs a CUDA GPU::

    PYTHONPATH=src python lab/hf_static_speed.py --layers 8 --new 64
"""

from __future__ import annotations

import argparse
import time

import torch
import transformers

import kbit
from kbit.hf.decode import StaticDecoder


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--compile", action="store_true", help="also transformers' generate with torch.compile")
    a = p.parse_args()
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                   num_key_value_heads=8, num_hidden_layers=a.layers, vocab_size=128256,
                                   max_position_embeddings=4096)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    kbit.quantize_model(model, k=a.k)
    ids = torch.randint(0, cfg.vocab_size, (1, a.prompt), device="cuda")
    rows = []
    gen = dict(max_new_tokens=a.new, min_new_tokens=a.new, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        model.generate(ids, **gen)  # warm-up: kernels compiled, plans chosen
        rows.append(("transformers generate, static cache", a.new / _timed(lambda: model.generate(ids, **gen))))
        if a.compile:
            model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=False)
            model.generate(ids, **gen)
            rows.append(("transformers generate, static cache, torch.compile",
                         a.new / _timed(lambda: model.generate(ids, **gen))))
            model.forward = model.__class__.forward.__get__(model)
        dec = StaticDecoder(model, 1, a.prompt + a.new + 1)

        def run_dec():
            dec.prefill(ids)
            for _ in range(a.new - 1):
                dec.step()

        run_dec()
        rows.append(("kbit StaticDecoder (CUDA graph a step)", a.new / _timed(run_dec)))
    print(f"\nLlama-3-8B-shaped, {a.layers} layers, k = {a.k}, batch 1, prompt {a.prompt}, {a.new} new tokens, "
          f"{torch.cuda.get_device_name()}")
    print("| decoder | tokens/s | x StaticDecoder |\n|---|--:|--:|")
    ref = rows[-1][1]
    for name, tps in rows:
        print(f"| {name} | {tps:.1f} | {tps / ref:.2f} |")


if __name__ == "__main__":
    main()
