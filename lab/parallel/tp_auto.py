"""transformers' ``tp_plan="auto"`` with kbit, under torchrun: a float folder quantized while loading
(``quantization_config=KbitConfig(k=...)``) or a kbit folder, split over the ranks by ``from_pretrained`` itself;
greedy tokens and first-step logits checked against the same model on one device.

    torchrun --nproc-per-node 2 lab/parallel/tp_auto.py --random llama --layers 4 --steps 64
    torchrun --nproc-per-node 2 lab/parallel/tp_auto.py --random qwen3_moe --layers 4 --steps 64
    torchrun --nproc-per-node 2 lab/parallel/tp_auto.py FOLDER --k 4 --steps 64
    PYTHONPATH=src torchrun --nproc-per-node 2 lab/parallel/tp_auto.py --random llama --small --cpu --steps 8

``--random TYPE``: rank 0 first writes a random float model of full-size layer shapes (Llama-3-8B, or
Qwen3-30B-A3B for ``qwen3_moe``; ``--small``: tiny) with ``--layers`` layers to ``--out``. Each rank reports its
k-bit bytes, the model's sharded modules and (on a GPU) its peak memory; ``--no-check`` skips the whole copy.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch
import torch.distributed as dist
from rank_setup import init_ranks  # this file's folder is on sys.path

import kbit  # noqa: F401  (registers KbitConfig with transformers)
from kbit.hf import KbitConfig
from kbit.hf.tp import TensorParallelKbitExperts
from kbit.parallel import ColumnParallelKbitLinear, RowParallelKbitLinear

SHAPES = {  # full-size layers of a model of the family; --small: tiny, odd sizes
    "llama": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  head_dim=128, vocab_size=32000),
    "qwen3_moe": dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                      head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                      vocab_size=32000, decoder_sparse_step=1),
}
SMALL = dict(hidden_size=200, intermediate_size=330, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             vocab_size=300, moe_intermediate_size=96, num_experts=5, num_experts_per_tok=2)


def write_random(model_type: str, layers: int, small: bool, out: str) -> None:
    import transformers  # optional dependency of kbit

    shape = {k: v for k, v in SMALL.items() if k in SHAPES[model_type] or k == "intermediate_size"} if small \
        else SHAPES[model_type]
    config = transformers.AutoConfig.for_model(model_type, num_hidden_layers=layers, max_position_embeddings=4096,
                                               tie_word_embeddings=False, **shape)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)


def load(folder: str, k: int, tp: bool, device):
    import transformers  # optional dependency of kbit

    with open(os.path.join(folder, "config.json")) as f:
        quantized = (json.load(f).get("quantization_config") or {}).get("quant_method") == "kbit"
    kw = {} if quantized else {"quantization_config": KbitConfig(k=k)}
    kw |= {"tp_plan": "auto"} if tp else {"device_map": str(device)}
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    with warnings.catch_warnings():  # transformers 5.24 prefers distributed_config=DistributedConfig(tp_plan=...)
        warnings.simplefilter("ignore", FutureWarning)
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw).eval()


def kbit_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for n, t in model.named_buffers() if n.endswith((".codes", ".scales")))


def greedy(model, ids: torch.Tensor, steps: int) -> tuple[torch.Tensor, float]:
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
    sync()
    return out[:, ids.shape[1]:], (time.perf_counter() - t0) / steps * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", nargs="?", help="a float or a kbit folder (or --random)")
    p.add_argument("--random", choices=sorted(SHAPES), help="write a random model of this family first")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--small", action="store_true", help="with --random: tiny layers")
    p.add_argument("--out", default=None, help="with --random: where (default /tmp/kbit-tp-auto-TYPE)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--prompt-ids", type=int, nargs="+", default=[1, 5, 7, 9, 11])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU")
    p.add_argument("--no-check", action="store_true", help="skip the whole copy on one device")
    args = p.parse_args()
    rank, world, device, _ = init_ranks(args.cpu)
    folder = args.folder
    if args.random:
        folder = args.out or f"/tmp/kbit-tp-auto-{args.random}{'-small' if args.small else ''}"
        if rank == 0 and not os.path.exists(os.path.join(folder, "config.json")):
            write_random(args.random, args.layers, args.small, folder)
        dist.barrier()
    if folder is None:
        p.error("FOLDER or --random is needed")
    model = load(folder, args.k, True, device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    parallel = (ColumnParallelKbitLinear, RowParallelKbitLinear, TensorParallelKbitExperts)
    sharded = sum(isinstance(m, parallel) for m in model.modules())
    ids = torch.tensor([args.prompt_ids], device=device)
    with torch.no_grad():
        logits = model(ids).logits.float()
    tokens, ms = greedy(model, ids, args.steps)
    print(f"rank {rank}/{world}: {sharded} modules sharded, {kbit_bytes(model) / 2**20:.1f} MiB of k-bit codes and "
          f"scales, peak {peak:.2f} GiB while loading, {ms:.1f} ms a token (eager generate)", flush=True)
    if rank == 0:
        print("tokens:", tokens[0].tolist())
    if args.no_check:
        return
    whole = load(folder, args.k, False, device)
    with torch.no_grad():
        want = whole(ids).logits.float()
    want_tokens, ms_one = greedy(whole, ids, args.steps)
    err = ((logits - want).abs().max() / want.abs().max()).item()
    # teacher-forced over the one-device greedy sequence: where the two argmaxes differ, the one-device top-2 gap
    # must be within twice the logit difference there (a near-tie that bf16 rounding may tip either way)
    seq = torch.cat([ids, want_tokens], dim=1)
    with torch.no_grad():
        a, b = whole(seq).logits[0, ids.shape[1] - 1:-1].float(), model(seq).logits[0, ids.shape[1] - 1:-1].float()
    differ = (a.argmax(-1) != b.argmax(-1)).nonzero().flatten().tolist()
    top2 = a.topk(2, dim=-1).values
    ties = [i for i in differ if (top2[i, 0] - top2[i, 1]) <= 2 * (a[i] - b[i]).abs().max()]
    ok = torch.tensor([int(torch.equal(tokens, want_tokens) or len(ties) == len(differ))], device=device)
    dist.all_reduce(ok)
    same = "identical" if torch.equal(tokens, want_tokens) else "part"
    print(f"rank {rank}: whole model {kbit_bytes(whole) / 2**20:.1f} MiB, {ms_one:.1f} ms a token on one device; "
          f"logits differ by {err:.2e} of max |logit|; greedy tokens {same}; teacher-forced argmax differs at "
          f"{len(differ)} of {args.steps} positions, {len(ties)} of them near-ties", flush=True)
    if rank == 0:
        verdict = "correct" if ok.item() == world else "MISMATCH"
        print(f"{verdict}: on {ok.item()} of {world} ranks the greedy tokens are identical or part only at "
              f"near-ties (teacher-forced argmax differences within 2x the logit difference)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
