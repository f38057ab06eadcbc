"""Capability run (issue 37): a Qwen3-235B-A22B-shaped model at k = 4 from a sharded checkpoint on 2 GPUs.

    torchrun --nproc-per-node 2 lab/parallel/big_model.py --layers 4          # smoke test, ~6 GB of files
    torchrun --nproc-per-node 2 lab/parallel/big_model.py                     # all 94 layers, ~127 GB of files
    PYTHONPATH=src torchrun --nproc-per-node 2 lab/parallel/big_model.py --cpu --layers 2   # checks the script

The shape comes from kbit's model suite (``src/kbit/bench/suites/models.json``, "Qwen3-235B-A22B"): 94 decoder
layers, hidden 4096, 64 query / 4 KV heads of 128, 128 experts (top 8) of intermediate 1536, vocabulary 151936.
No model is ever built in bf16, nor whole: every rank

1. makes the model's skeleton on the ``meta`` device (no memory) and the checkpoint's layout from it
   (``kbit.parallel.shard_layout``: q/k/v packed and column-parallel, o row-parallel, the MoE blocks expert
   parallel, ``lm_head`` column-parallel with a gathered output, the embedding and norms replicated);
2. writes its own file, tensor by tensor in layer order (``kbit.parallel.ShardWriter``): random packed codes
   and block scales made on its GPU, a weight scale that keeps the activations in range; rank 0 writes the index;
3. loads its file alone (``kbit.parallel.load_sharded``, module by module onto its GPU) and prints its load time,
   peak GPU memory and the bytes it holds;
4. decodes ``--steps`` greedy steps at each batch of ``--batches`` (CUDA graphs unless ``--no-graph``) with a
   static KV cache of ``--context`` positions (the attention reads the whole cache every step: the byte cost of
   decoding at that context, not a masked attention), and prints tokens/s and whether both ranks chose the same
   tokens (they must: every rank ends with the same logits).

The files go to ``--dir`` (default: the first of /dev/shm, $TMPDIR or /tmp, and the current directory with room
for them) and are deleted at the end unless ``--keep`` (``--reuse`` loads an existing checkpoint directory).
Without room for every rank's file at once (or with ``--one-at-a-time``), the index is written from a dry pass
(the checksums of the seeded data) and each rank in turn writes its file, loads it and deletes it: the same
checkpoint files, never all on disk together.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import time
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from rank_setup import init_ranks  # this file's folder is on sys.path
from torch import nn

from kbit.nn import KbitLinear, KbitMoE
from kbit.ops.glue import rms_norm
from kbit.parallel import ShardWriter, all_reduce_sum, load_sharded, shard_layout, shard_specs, write_index
from kbit.parallel.checkpoint import INDEX_NAME, rank_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLAN = {"layers.*.attn.qkv_proj": "packed_colwise", "layers.*.attn.o_proj": "rowwise", "layers.*.mlp": "ep",
        "lm_head": "colwise"}
#: --cpu: a tiny model of the same structure (2 query heads and 1 KV head a rank)
CPU_SHAPE = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
             "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "vocab_size": 1000,
             "num_hidden_layers": 2}
EPS = 1e-6


def suite_shape(name: str = "Qwen3-235B-A22B") -> dict:
    with open(os.path.join(ROOT, "src/kbit/bench/suites/models.json")) as f:
        models = json.load(f)["models"]
    return next(m["config"] for m in models if m["name"] == name)


class Attention(nn.Module):
    def __init__(self, c: dict, kw: dict):
        super().__init__()
        d, hq, hkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
        self.head_dim = d
        self.qkv_proj = KbitLinear(c["hidden_size"], (hq + 2 * hkv) * d, bias=False, **kw)
        self.qkv_proj.packed_parts = (hq * d, hkv * d, hkv * d)
        self.o_proj = KbitLinear(hq * d, c["hidden_size"], bias=False, **kw)

    def parts(self) -> list[int]:
        """Widths of q, k, v in this rank's ``qkv_proj`` output (column-parallel: its slice of each)."""
        return list(getattr(self.qkv_proj, "local_parts", None) or self.qkv_proj.packed_parts)

    def forward(self, x, cache_k, cache_v, pos):
        """x ``[B, H]``; the caches ``[B, kv heads, S, D]`` (this rank's heads); ``pos`` int64 ``[1]``."""
        B, d = x.shape[0], self.head_dim
        q, k, v = self.qkv_proj(x).split(list(self.parts()), dim=-1)
        cache_k.index_copy_(2, pos, k.view(B, -1, 1, d))
        cache_v.index_copy_(2, pos, v.view(B, -1, 1, d))
        a = F.scaled_dot_product_attention(q.view(B, -1, 1, d), cache_k, cache_v, enable_gqa=True)
        return self.o_proj(a.reshape(B, -1))


def norm(x, w):
    if x.is_cuda:  # one kernel (Triton); the CPU check runs plain torch
        return rms_norm(x, w, EPS)
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * w


class Layer(nn.Module):
    def __init__(self, c: dict, kw: dict):
        super().__init__()
        H = c["hidden_size"]
        self.input_norm = nn.Parameter(torch.ones(H, dtype=kw["dtype"], device=kw["device"]))
        self.post_norm = nn.Parameter(torch.ones(H, dtype=kw["dtype"], device=kw["device"]))
        self.attn = Attention(c, kw)
        self.mlp = KbitMoE(c["num_experts"], H, c["moe_intermediate_size"], c["num_experts_per_tok"],
                           has_router_weight=True, **kw)

    def forward(self, x, cache_k, cache_v, pos):
        x = x + self.attn(norm(x, self.input_norm), cache_k, cache_v, pos)
        return x + self.mlp(norm(x, self.post_norm))


class Model(nn.Module):
    def __init__(self, c: dict, dtype: torch.dtype, device="meta"):
        super().__init__()
        kw = dict(k=4, blocksize=32, dtype=dtype, device=device)
        self.embed = nn.Embedding(c["vocab_size"], c["hidden_size"], dtype=dtype, device=device)
        self.layers = nn.ModuleList(Layer(c, kw) for _ in range(c["num_hidden_layers"]))
        self.norm = nn.Parameter(torch.ones(c["hidden_size"], dtype=dtype, device=device))
        self.lm_head = KbitLinear(c["hidden_size"], c["vocab_size"], bias=False, **kw)

    def new_caches(self, batch: int, context: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed K and V caches ``[batch, kv heads here, context, head_dim]`` for every layer."""
        attn = self.layers[0].attn
        shape = (batch, attn.parts()[1] // attn.head_dim, context, attn.head_dim)
        return [(torch.zeros(shape, dtype=self.norm.dtype, device=device),
                 torch.zeros(shape, dtype=self.norm.dtype, device=device)) for _ in self.layers]

    def logits(self, ids, caches, pos):
        """This rank's logits ``[B, vocab here]`` of a step (the caches written at ``pos``)."""
        x = self.embed(ids)
        for layer, (ck, cv) in zip(self.layers, caches, strict=True):
            x = layer(x, ck, cv, pos)
        return self.lm_head(norm(x, self.norm))

    def step(self, ids, caches, pos):
        """One greedy step in place: ``ids [B]`` become the next tokens, ``pos`` advances (mod the context)."""
        logits = self.logits(ids, caches, pos)
        start = getattr(self.lm_head, "start", None)  # column-parallel: the vocabulary is split over the ranks
        ids.copy_(logits.argmax(-1) if start is None else vocab_argmax(logits, start))
        pos.add_(1).remainder_(caches[0][0].shape[2])


def vocab_argmax(logits: torch.Tensor, start: int) -> torch.Tensor:
    """The greedy token of logits split over the ranks by vocabulary (``lm_head`` column-parallel, rows
    ``start:...`` here): each rank's best (value, id) in its row of a ``[world, B, 2]`` table, summed over the ranks
    (one small all-reduce instead of gathering ``[B, vocab]``); ties go to the lower id, as ``argmax``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    val, idx = logits.float().max(-1)
    table = torch.zeros(world, logits.shape[0], 2, dtype=torch.float32, device=logits.device)
    table[rank] = torch.stack([val, (idx + start).float()], -1)  # ids < 2**24: exact in float32
    table = all_reduce_sum(table)
    best = table[..., 0].argmax(0, keepdim=True)
    return table[..., 1].gather(0, best).squeeze(0).long()


# -- writing ---------------------------------------------------------------------------------------------------


def random_tensor(name: str, dtype: torch.dtype, shape, rank: int, device, replicated: bool,
                  tensor_scales: dict) -> torch.Tensor:
    """A tensor of the checkpoint: random codes, block scales, weight scales sized to keep activations in range
    (``tensor_scales``: weight name -> value), a uniform codebook, unit norms; replicated tensors the same on every
    rank (seeded by name only)."""
    g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()) + (0 if replicated else 7919 * rank))
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "codes":  # any bit pattern is a valid code
        n = 4 * int(torch.Size(shape).numel())
        return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8, device=device).view(torch.int32).view(shape)
    if leaf == "scales":  # log8: 2**(-q/16) of the tensor scale, q in [0, 24)
        return torch.randint(0, 24, shape, generator=g, dtype=torch.uint8, device=device)
    if leaf == "codebook":
        return torch.linspace(-1, 1, shape[0], dtype=dtype, device=device)
    if leaf == "tensor_scale":
        return torch.full(shape, tensor_scales[name.rsplit(".", 1)[0]], dtype=dtype, device=device)
    if "norm" in name:
        return torch.ones(shape, dtype=dtype, device=device)
    scale = 1.0 if leaf == "weight" else shape[-1] ** -0.5  # the embedding ~ N(0, 1); the router ~ N(0, 1/H)
    return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)



def same_on_every_rank(name: str, layout: dict) -> bool:
    """Whether tensor ``name`` of a rank file is replicated: the unplanned tensors, and an expert-parallel block's
    router (every rank routes every token with the whole router); shards differ by rank."""
    return name in layout["replicated"] or name.rsplit(".", 1)[-1] in ("router_weight", "correction_bias")


def write_rank(layout: dict, directory: str, rank: int, world: int, device, dry_run: bool = False
               ) -> tuple[dict, dict]:
    """This rank's file, tensor by tensor in layer order (``dry_run``: only the checksums; the data is seeded, so
    a later real write gives the same file). Returns its record for the index and the CRC-32s of its replicated
    tensors."""
    specs, weights = shard_specs(layout, rank)
    # a weight's absmax about 3 / sqrt(K): its entries ~ 1 / sqrt(K), so a layer keeps the scale of its input
    tensor_scales = {name: 3.0 * meta["shape"][-1] ** -0.5 for name, meta in weights.items()}
    writer = ShardWriter(os.path.join(directory, rank_file(rank, world)), specs, weights,
                         {"kbit.shard": json.dumps({"rank": rank, "world": world})}, dry_run=dry_run)
    try:
        for name, (dtype, shape) in specs.items():
            writer.write(name, random_tensor(name, dtype, shape, rank, device, same_on_every_rank(name, layout),
                                             tensor_scales))
    except BaseException:
        writer.abort()
        raise
    record = writer.close()
    return record, {n: writer.crc[n] for n in specs if same_on_every_rank(n, layout)}


def file_bytes(layout: dict, rank: int) -> int:
    specs, _ = shard_specs(layout, rank)
    return sum(torch.empty((), dtype=dt).element_size() * int(torch.Size(s).numel()) for dt, s in specs.values())


def pick_dir(arg: str | None, need: int) -> tuple[str | None, str]:
    """(``arg``, or the first candidate folder with ``need`` bytes free and 2 GiB to spare; a note on the free
    space); None where none has room."""
    def free(path):
        while not os.path.isdir(path):
            path = os.path.dirname(path) or "."
        return shutil.disk_usage(path).free

    cands = [arg] if arg else list(dict.fromkeys(["/dev/shm", os.environ.get("TMPDIR", "/tmp"), "/tmp", os.getcwd()]))
    note = "free: " + ", ".join(f"{c} {free(c) / 2**30:.1f} GiB" for c in cands if c)
    for c in cands:
        if c and free(c) >= need + 2 * 2**30:
            return (c if arg else os.path.join(c, "kbit-big-model")), note
    return None, note


# -- decoding --------------------------------------------------------------------------------------------------


def decode(model, batch: int, steps: int, context: int, device, graph: bool = True, say=print, forced=None):
    """Greedy decoding of ``steps`` steps at ``batch`` from fixed start tokens and empty caches, as CUDA-graph
    replays of one step where ``graph`` (else, or where capture fails, eager steps). ``forced`` (int64
    ``[steps, batch]``): step ``i`` reads ``forced[i - 1]`` instead of the model's own last tokens (teacher
    forcing: each step's choice from the same history as the model that made ``forced``).

    Returns (tokens int64 ``[steps, batch]`` on the CPU, seconds of the timed steps, "CUDA graph" or "eager")."""
    caches = model.new_caches(batch, context, device)
    start = torch.arange(batch, device=device) * 7 + 1
    ids, pos = start.clone(), torch.zeros(1, dtype=torch.long, device=device)
    run, mode = (lambda: model.step(ids, caches, pos)), "eager"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        for _ in range(2):  # compiles, repacks, makes the all-reduce buffers
            run()
        if device.type == "cuda" and graph:
            try:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    run()
                torch.cuda.current_stream().wait_stream(s)
                cuda_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(cuda_graph):
                    run()
                run, mode = cuda_graph.replay, "CUDA graph"
            except RuntimeError as e:  # report and time eagerly instead
                say(f"batch {batch}: CUDA graph capture failed ({e}); eager steps")
        ids.copy_(start)  # the timed steps start from the same state whatever ran before
        pos.zero_()
        for ck, cv in caches:
            ck.zero_()
            cv.zero_()
        out = torch.empty(steps, batch, dtype=torch.long, device=device)
        forced = None if forced is None else forced.to(device)
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for i in range(steps):
            if forced is not None and i:
                ids.copy_(forced[i - 1])
            run()
            out[i].copy_(ids)
        sync()
        dt = time.perf_counter() - t0
    return out.cpu(), dt, mode


def timed_decode(model, batch: int, args, device, say) -> torch.Tensor:
    """:func:`decode` and its table row: ms a step, tokens/s (the slower rank), whether the ranks chose the same
    tokens."""
    tokens, dt, mode = decode(model, batch, args.steps, args.context, device, not args.no_graph, say)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, tokens.tolist())
    agree = all(t == every[0] for t in every)
    rate = torch.tensor([batch * args.steps / dt], device=device if device.type == "cuda" else "cpu")
    dist.all_reduce(rate, op=dist.ReduceOp.MIN)
    say(f"| {batch} | {mode} | {1e3 * dt / args.steps:.2f} | {rate.item():.1f} | {'yes' if agree else 'NO'} |")
    return tokens


def anon_gib() -> float:
    """This process's anonymous resident memory (its own allocations; RSS also counts the mapped checkpoint's
    pages, which are the page cache, not a copy)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:")) / 2**20
    except (OSError, StopIteration):
        return float("nan")


def memory_line(tag: str, device, seconds: float) -> str:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    host = f"host peak RSS {rss:.1f} GiB (anonymous now {anon_gib():.1f})"
    if device.type == "cuda":
        torch.cuda.synchronize()
        return (f"{tag}: {seconds:.1f} s, GPU peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
                f" (now {torch.cuda.memory_allocated() / 2**30:.2f}), {host}")
    return f"{tag}: {seconds:.1f} s, {host}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's 94)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--context", type=int, default=1024, help="KV cache positions read every step")
    p.add_argument("--dir", default=None, help="where the checkpoint goes (default: see the module docstring)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoint files")
    p.add_argument("--reuse", action="store_true", help="load --dir as it is (written by an earlier --keep run)")
    p.add_argument("--one-at-a-time", action="store_true",
                   help="each rank writes, loads and deletes its file in turn (chosen anyway without room for all)")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU, a tiny model of the same structure")
    args = p.parse_args()
    rank, world, device, say = init_ranks(args.cpu)
    dtype, c = (torch.float32, dict(CPU_SHAPE)) if args.cpu else (torch.bfloat16, suite_shape())
    if args.layers:
        c["num_hidden_layers"] = args.layers
    layout = shard_layout(Model(c, dtype), PLAN, world)
    sizes = [file_bytes(layout, r) for r in range(world)]
    say(f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_experts']} experts top "
        f"{c['num_experts_per_tok']}, k=4, world {world}: files {' + '.join(f'{s / 2**30:.2f}' for s in sizes)} GiB")
    box = [storage(args, sizes) if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    directory, note, one_at_a_time = box[0]
    say(note)
    if directory is None:
        dist.destroy_process_group()
        raise SystemExit(f"no room for the checkpoint ({max(sizes) / 2**30:.1f} GiB a rank); pass --dir or --layers")
    try:
        model, notes = write_and_load(layout, directory, one_at_a_time, args.reuse, c, dtype, device)
        held = sum(t.numel() * t.element_size() for t in model.state_dict().values() if isinstance(t, torch.Tensor))
        notes.append(memory_line(f"rank {rank} loaded {held / 2**30:.2f} GiB", device, notes.pop()))
        every = [None] * world
        dist.all_gather_object(every, notes)
        for line in (line for lines in every for line in lines):
            say(line)
        say("\n| batch | step | ms/step | tokens/s | ranks agree |\n|---|---|---|---|---|")
        t0 = time.perf_counter()
        for batch in args.batches:
            timed_decode(model, batch, args, device, say)
        dist.all_gather_object(every, memory_line(f"rank {rank} after decoding", device, time.perf_counter() - t0))
        for line in every:
            say(line)
    finally:
        dist.barrier()
        if not args.keep and not args.reuse:
            path = os.path.join(directory, rank_file(rank, world))
            if os.path.exists(path):
                os.unlink(path)
            dist.barrier()
            if rank == 0 and os.path.exists(os.path.join(directory, INDEX_NAME)):
                os.unlink(os.path.join(directory, INDEX_NAME))
                if not os.listdir(directory):
                    os.rmdir(directory)
        dist.destroy_process_group()


def storage(args, sizes: list[int]) -> tuple[str | None, str, bool]:
    """(folder, note on free space, one rank file at a time): room for every rank's file at once, else (or with
    ``--one-at-a-time``) for the largest; ``--reuse``: the folder as it is."""
    if args.reuse:
        return args.dir, "", False
    directory, note = (None, "") if args.one_at_a_time else pick_dir(args.dir, sum(sizes))
    if directory is not None:
        return directory, note, False
    directory, note = pick_dir(args.dir, max(sizes))
    return directory, note + ("; one rank file at a time" if directory else ""), True


def write_and_load(layout: dict, directory: str, one_at_a_time: bool, reuse: bool, c: dict, dtype, device):
    """Write the checkpoint and load this rank's part. Together: every rank writes its file, rank 0 the index,
    then every rank loads its own. One at a time (no room for all files at once): the index from a dry pass (the
    checksums of the seeded data), then each rank in turn writes its file, loads it and deletes it. Returns the
    model and this rank's notes, the last being its load time in seconds."""
    rank, world = dist.get_rank(), dist.get_world_size()
    notes, t0 = [], time.perf_counter()
    if not reuse:
        os.makedirs(directory, exist_ok=True)
        record, replicated = write_rank(layout, directory, rank, world, device, dry_run=one_at_a_time)
        every = [None] * world
        dist.all_gather_object(every, (record, replicated))
        if any(rep != every[0][1] for _, rep in every):
            raise SystemExit("the ranks' replicated tensors differ (a seeding bug of this script)")
        if rank == 0:
            write_index(directory, layout, [rec for rec, _ in every])
        dist.barrier()
        what = "checksummed (dry pass)" if one_at_a_time else f"wrote {rank_file(rank, world)}"
        notes.append(memory_line(f"rank {rank} {what}", device, time.perf_counter() - t0))
    model = None
    for turn in range(world) if one_at_a_time else [rank]:
        if turn == rank:
            if one_at_a_time:
                t0 = time.perf_counter()
                write_rank(layout, directory, rank, world, device)
                notes.append(memory_line(f"rank {rank} wrote {rank_file(rank, world)}", device,
                                         time.perf_counter() - t0))
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            model = load_sharded(directory, model=Model(c, dtype), device=device,
                                 check_replicated=not one_at_a_time)  # checked above, from the checksums
            load_s = time.perf_counter() - t0
            if one_at_a_time:
                os.unlink(os.path.join(directory, rank_file(rank, world)))
        if one_at_a_time:
            dist.barrier()
    return model, notes + [load_s]


if __name__ == "__main__":
    main()
