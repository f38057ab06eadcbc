"""Tensor-parallel decode tokens/s (issue 37): a random-initialised transformers model (bench_e2e's configs:
Llama-3-8B-, Qwen3-8B-, Qwen3-30B-A3B-shaped) at k bits on one GPU against the same model split over the ranks of
``torchrun`` (``kbit.parallel.parallelize_kbit``: q/k/v and gate/up column-parallel, o/down row-parallel, MoE blocks
expert-parallel, the bf16 ``lm_head`` split by vocabulary and gathered), and bf16 on one GPU, in one run; the
decode loop is bench_e2e's (``kbit.hf.StaticDecoder``, CUDA graphs, a prompt of ``--ctx`` random tokens,
``--steps`` steps timed with CUDA events, median of ``--reps``; the slower rank's time).

    torchrun --nproc-per-node 2 benchmarks/bench_tp.py [--models llama3-8b,qwen3-30b-a3b] [--k 4] [--batch 1,16,64]
    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/bench_tp.py --tiny    # CPU smoke test (gloo, no graphs)

Every rank builds the same weights (one seed), times bf16 and the whole k-bit model on its own GPU (each rank at
once, on different GPUs), then its shard. Greedy tokens of the TP model are compared with the one-GPU model's
over the timed steps at batch 1 (random weights give near-ties, where bf16 rounding may part them: the step where
they part is recorded, with the one-GPU top-2 logit gap there). Writes ``tp.json`` / ``tp.md`` to ``$OUT``
(default benchmarks/results/<gpu>x<world>/) and prints a short table last. ``--profile`` adds the step profile
(``kbit.bench.step_profile``, as ``bench_e2e.py --profile``) of each k-bit row, one GPU and TP, under
``$OUT/profile/``: the kernels of one step with their times and the gaps between them.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
# this checkout's kbit, unless PYTHONPATH names another tree that has one (an A/B of two trees runs this file with
# PYTHONPATH at each)
if not any((Path(p) / "kbit").is_dir() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
    sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_e2e import (  # noqa: E402
    build_bf16,
    build_kbit,
    configs,
    git_commit,
    read_ceiling,
    time_decode,
    weight_bytes,
    with_layers,
)

from kbit.hf.decode import StaticDecoder  # noqa: E402
from kbit.nn import KbitMoE  # noqa: E402
from kbit.parallel import LLAMA_PLAN, QWEN3_MOE_PLAN, parallelize_kbit  # noqa: E402
from kbit.tuning.tables import gpu_key  # noqa: E402

#: the dense plan plus the bf16 lm_head split by vocabulary (transformers' LlamaForCausalLM._tp_plan)
PLAN = {**LLAMA_PLAN, "lm_head": "colwise_rep"}
#: MoE models (bench_e2e's KbitMoE blocks): attention as above, each block's experts split over the ranks
MOE_PLAN = {**QWEN3_MOE_PLAN, "lm_head": "colwise_rep"}


def tiny_configs() -> dict:
    """bench_e2e's tiny CPU models, widened so that their heads split over 2 ranks on whole 32-column blocks (a KV
    head there is 16 wide)."""
    return {name: type(c)(**(c.to_dict() | dict(hidden_size=128, intermediate_size=256, head_dim=32)))
            for name, c in configs(tiny=True).items()}


def plan_of(model) -> dict:
    return MOE_PLAN if any(isinstance(m, KbitMoE) for m in model.modules()) else PLAN
TARGETS = {1: 0.75, 16: 0.6}  # issue 37: TP step <= this x the one-GPU step


def slowest(ms: float) -> float:
    t = torch.tensor([ms], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def timed(model, batch: int, args, profile: str | None = None) -> dict:
    """bench_e2e's decode timing on every rank, the slower rank's time; ``profile``: a file stem (under
    ``--out``'s ``profile/``) for the step profile of this row (every rank profiles the same step, since the
    collectives need both; other ranks write theirs under ``profile/rank<r>/``)."""
    dist.barrier()
    kw = {}
    if profile and args.profile:
        rank = dist.get_rank()
        base = Path(args.out_dir) / "profile" / ("" if rank == 0 else f"rank{rank}")
        kw["profile"] = dict(stem=base / profile, title=f"{profile} rank {dist.get_rank()}",
                             ceiling=read_ceiling(None, "cuda"))
    row = time_decode(model, batch, args.ctx, args.steps, args.reps, not args.tiny, **kw)
    row["ms_per_step"] = slowest(row["ms_per_step"])
    row["tokens_per_s"] = batch * 1e3 / row["ms_per_step"]
    return row


def greedy(model, ctx: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch-1 greedy tokens ``[steps]`` and their logits ``[steps, V]`` after a random prompt (seed 0)."""
    dev = next(model.parameters()).device
    dec = StaticDecoder(model, 1, ctx + steps + 8, graph=dev.type == "cuda")
    prompt = torch.randint(0, model.config.vocab_size, (1, ctx), device=dev,
                           generator=torch.Generator(device=dev).manual_seed(0))
    toks, logits = [dec.prefill(prompt)[0].clone()], [dec.logits[0].clone()]
    for _ in range(steps - 1):
        toks.append(dec.step()[0].clone())
        logits.append(dec.logits[0].clone())
    dec.release()
    return torch.stack(toks), torch.stack(logits)


def agreement(whole, tp, ctx: int, steps: int) -> dict:
    wt, wl = greedy(whole, ctx, steps)
    gt, _ = greedy(tp, ctx, steps)
    if torch.equal(wt, gt):
        return {"greedy_steps": steps, "identical": True}
    s = int((wt != gt).nonzero()[0])
    top2 = wl[s].topk(2).values
    return {"greedy_steps": steps, "identical": False, "parts_at": s, "top2_gap_there": (top2[0] - top2[1]).item()}


def markdown(meta: dict, rows: list) -> str:
    out = [f"# Tensor-parallel decode, {meta['gpu']} x {meta['world']}, {meta['date']}, commit {meta['commit']}", "",
           f"    {meta['command']}", "",
           f"ms per decode step ({'eager, CPU' if meta['gpu'] == 'cpu' else 'CUDA graph'}, context {meta['ctx']}, "
           "slower rank), tokens/s; "
           "TP / one GPU against issue 37's targets.", "",
           "| model | k | batch | bf16 1 GPU ms | k-bit 1 GPU ms | k-bit TP ms | TP / 1 GPU | target | TP tokens/s | "
           "TP x bf16 |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['k']} | {r['batch']} | {r['bf16_ms']:.3f} | {r['one_ms']:.3f} | "
                   f"{r['tp_ms']:.3f} | {r['tp_ms'] / r['one_ms']:.3f} | {TARGETS.get(r['batch'], '-')} | "
                   f"{r['tp_tokens_per_s']:.0f} | {r['bf16_ms'] / r['tp_ms']:.2f} |")
    out += ["", "Greedy tokens, batch 1, TP against one GPU: " + json.dumps(meta.get("agreement", {})),
            f"Bytes per rank: {json.dumps(meta.get('bytes', {}))}"]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="llama3-8b")
    p.add_argument("--k", default="4")
    p.add_argument("--batch", default="1,16,64")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (quick runs)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument("--tiny", action="store_true", help="tiny configs on the CPU, gloo, no graphs (a smoke test)")
    p.add_argument("--profile", action="store_true",
                   help="also the step profile (kbit.bench.step_profile) of the one-GPU and TP k-bit rows, in "
                        "OUT/profile/")
    args = p.parse_args(argv)
    dist.init_process_group("gloo" if args.tiny else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.tiny:
        device = torch.device("cpu")
        args.models = args.models if args.models != "llama3-8b" else "llama-tiny,qwen3moe-tiny"
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"{gpu_key(device)}x{world}")
    args.out_dir = out
    args.profile = args.profile and device.type == "cuda"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {"gpu": gpu, "world": world, "commit": git_commit(),
            "date": datetime.date.today().isoformat(), "ctx": args.ctx, "torch": torch.__version__,
            "command": f"torchrun --nproc-per-node {world} benchmarks/bench_tp.py {' '.join(argv or sys.argv[1:])}"}
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    for name in args.models.split(","):
        config = with_layers((tiny_configs() if args.tiny else configs())[name], args.layers)
        model = build_bf16(config, device)
        bf16 = {b: timed(model, b, args)["ms_per_step"] for b in batches}
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        for k in (int(x) for x in args.k.split(",")):
            whole = build_kbit(config, device, k, fuse_proj=True)
            tp = copy.deepcopy(whole)
            parallelize_kbit(tp, plan_of(whole))
            meta.setdefault("bytes", {})[f"{name} k={k}"] = {"whole_gib": weight_bytes(whole) / 2**30,
                                                             "rank_gib": weight_bytes(tp) / 2**30}
            meta.setdefault("agreement", {})[f"{name} k={k}"] = agreement(whole, tp, args.ctx, args.steps)
            for b in batches:
                one = timed(whole, b, args, f"step-{name}-one-k{k}-b{b}")
                par = timed(tp, b, args, f"step-{name}-tp{world}-k{k}-b{b}")
                rows.append({"model": name, "k": k, "batch": b, "bf16_ms": bf16[b], "one_ms": one["ms_per_step"],
                             "tp_ms": par["ms_per_step"], "tp_tokens_per_s": par["tokens_per_s"], "one": one,
                             "tp": par})
                if rank == 0:
                    print(f"{name} k={k} batch {b}: bf16 {bf16[b]:.3f} ms, one GPU {one['ms_per_step']:.3f}, "
                          f"TP={world} {par['ms_per_step']:.3f} ({par['ms_per_step'] / one['ms_per_step']:.3f}x)",
                          flush=True)
            del whole, tp
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "tp.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        text = markdown(meta, rows)
        (out / "tp.md").write_text(text)
        print(text)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
