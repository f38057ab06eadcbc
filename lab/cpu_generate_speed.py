"""CPU lab: greedy decode speed of the embedded default model (SmolLM2-135M-Instruct) on the CPU, plain
transformers in float32 against the same model after ``kbit.quantize_model`` (k = 4), through the same loop
(``kbit.hf.generate.generate_tokens``, transformers' dynamic cache; what ``kbit generate`` runs on the CPU).

The two models run alternately (``--rounds`` times, ``--tokens`` new tokens each) so that load from other
processes hits both alike; tokens/s is the median over rounds. Also prints whether both chose the same tokens.

    PYTHONPATH=src python lab/cpu_generate_speed.py [--tokens 32] [--rounds 5] [--threads N]
"""
import argparse
import copy
import statistics
import time

import torch

import kbit
from kbit.hf.generate import generate_tokens, load_default_model


def run(model, ids, n) -> tuple[float, list[int]]:
    t = time.perf_counter()
    toks = list(generate_tokens(model, ids, max_new_tokens=n, temperature=0.0, static=False))
    return len(toks) / (time.perf_counter() - t), toks


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load_default_model(torch.float32)
    q = kbit.quantize_model(copy.deepcopy(model), k=4, progress=False)
    ids = tok("The quick brown fox", return_tensors="pt").input_ids
    speeds = {"transformers fp32": [], "kbit k=4": []}
    tokens = {}
    for _ in range(a.rounds + 1):  # the first round warms up (fills kbit's kept weights)
        for name, m in (("transformers fp32", model), ("kbit k=4", q)):
            s, tokens[name] = run(m, ids, a.tokens)
            speeds[name].append(s)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.tokens} tokens x {a.rounds} rounds")
    for name, v in speeds.items():
        print(f"{name:>18}: {statistics.median(v[1:]):6.1f} tokens/s (rounds: {', '.join(f'{x:.1f}' for x in v[1:])})")
    same = sum(x == y for x, y in zip(tokens["transformers fp32"], tokens["kbit k=4"], strict=False))
    print(f"same greedy tokens: {same} of {a.tokens}")


if __name__ == "__main__":
    main()
