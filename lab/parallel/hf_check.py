"""A transformers Llama (random weights, Llama-3-8B layer sizes, few layers) quantized with kbit, at TP = 2 against
the same model on one GPU: greedy tokens over 64 steps and the logits, through transformers' ``generate`` and
through ``kbit.hf.StaticDecoder`` (CUDA-graph decode), with the decode step times of the latter.

    torchrun --nproc-per-node 2 lab/parallel/hf_check.py --layers 2
    torchrun --nproc-per-node 2 lab/parallel/hf_check.py --layers 32 --decoders static   # step times, 8B-sized
    PYTHONPATH=src torchrun --nproc-per-node 2 lab/parallel/hf_check.py --cpu --shrink 16 --decoders generate

Every rank builds the same model (rank 0's weights broadcast), quantizes it (``kbit.hf.quantize_model``, k = 4),
keeps a whole copy and parallelizes the other with the model's ``base_model_tp_plan`` (``lm_head`` too:
``colwise_rep``, where it is k-bit). Random weights give flat logits, so two greedy runs may part where the top
two logits of the one-GPU run are closer than the rounding difference; the script then says at which step and
by how much (teacher-forced agreement over the one-GPU tokens counts the rest).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as dist

from kbit.nn import KbitLinear
from kbit.parallel import parallelize_kbit


def build(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM  # optional dependency of kbit

    from kbit.hf import quantize_model

    s = args.shrink
    config = LlamaConfig(vocab_size=args.vocab // s, hidden_size=4096 // s, intermediate_size=14336 // s,
                         num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128 // s, max_position_embeddings=256, rope_theta=500000.0)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if not args.cpu else torch.float32)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    for t in model.state_dict().values():
        dist.broadcast(t, src=0)
    quantize_model(model, k=args.k, progress=False)
    return model


def plan_of(model) -> dict[str, str]:
    plan = dict(model.config.base_model_tp_plan)
    if isinstance(getattr(model, "lm_head", None), KbitLinear):
        plan["lm_head"] = "colwise_rep"  # transformers' LlamaForCausalLM._tp_plan
    return plan


def run_generate(model, ids, steps):
    out = model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, ids.shape[1]:], torch.stack([x[0].float() for x in out.logits])


def run_static(model, ids, steps):
    from kbit.hf.decode import StaticDecoder

    dec = StaticDecoder(model, 1, ids.shape[1] + steps + 1)

    def last():  # the logits of the one sequence's newest position
        return dec.logits.reshape(-1, dec.logits.shape[-1])[-1].float().clone()

    tokens = [dec.prefill(ids)[0].clone()]
    logits = [last()]
    for _ in range(steps - 1):
        tokens.append(dec.step()[0].clone())
        logits.append(last())
    ms = None
    if ids.is_cuda:  # the decode step's time: graph replays, after the steps above
        dec.prefill(ids)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps - 1):
            dec.step()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1000 / (steps - 1)
    dec.release()
    return torch.stack(tokens), torch.stack(logits), ms


def teacher_forced(model, ids, tokens) -> torch.Tensor:
    """The model's argmax at every position of the prompt + ``tokens`` (one forward)."""
    full = torch.cat([ids[0], tokens]).view(1, -1)
    return model(full).logits[0, ids.shape[1] - 1:-1].argmax(-1)


def compare(name, whole, tp, ids, steps, say) -> bool:
    run = run_generate if name == "generate" else run_static
    want = run(whole, ids, steps)
    got = run(tp, ids, steps)
    (wt, wl), (gt, gl) = want[:2], got[:2]
    same = torch.equal(wt, gt)
    rel = ((gl[-1] - wl[-1]).abs().max() / wl[-1].abs().max()).item()
    first = ((gl[0] - wl[0]).abs().max() / wl[0].abs().max()).item()
    say(f"{name}: tokens {'identical' if same else 'DIFFERENT'} over {steps} steps; first / last logits "
        f"max abs(TP - one GPU) / max abs = {first:.2e} / {rel:.2e}")
    if not same:
        s = int((wt != gt).nonzero()[0])
        top2 = wl[s].topk(2).values
        diff = (gl[s] - wl[s]).abs().max().item()
        agree = (teacher_forced(tp, ids, wt) == wt).float().mean().item()
        say(f"  first difference at step {s}: one-GPU top-2 gap {(top2[0] - top2[1]).item():.3e}, "
            f"max abs logit difference there {diff:.3e}; teacher-forced agreement {agree:.1%}")
    if len(want) > 2 and want[2] is not None:
        say(f"  decode step (CUDA graph): one GPU {want[2]:.3f} ms, TP {got[2]:.3f} ms, ratio {got[2] / want[2]:.2f}")
    return same


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt", type=int, default=8, help="prompt length (random token ids)")
    p.add_argument("--decoders", nargs="+", choices=("generate", "static"), default=["generate", "static"])
    p.add_argument("--shrink", type=int, default=1, help="divide the layer sizes (a quick check)")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU (checks this script)")
    args = p.parse_args()
    dist.init_process_group("gloo" if args.cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.cpu:
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    say = print if rank == 0 else (lambda *a, **kw: None)
    model = build(args, device)
    whole = copy.deepcopy(model)
    replaced = parallelize_kbit(model, plan_of(model))
    say(f"TP={world}: Llama, {args.layers} layers (sizes /{args.shrink}), k={args.k}, {len(replaced)} layers sharded")
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    ok = True
    with torch.no_grad():
        for name in args.decoders:
            try:
                ok &= compare(name, whole, model, ids, args.steps, say)
            except Exception as err:  # report and go on: the other decoder's result still counts
                say(f"{name}: FAILED with {type(err).__name__}: {err}")
                ok = False
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
