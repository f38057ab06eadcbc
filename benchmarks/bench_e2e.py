"""End-to-end decode tokens/s: random-initialised Llama-3-8B-, Qwen3-8B-, Qwen2.5-7B-, Qwen3-30B-A3B- and
Mixtral-8x7B-shaped transformers models, bf16 against kbit (k = 2..5), at batch 1, 4, 16, 64, the same decode loop
on both sides. The two MoE shapes lie at either end: 128 small experts, 8 a token (Qwen3-30B-A3B) and 8 large
ones, 2 a token (Mixtral).

Models are real transformers code built from configs (no download), directly on the GPU in bf16 (built on
the meta device, then each part materialised with ``to_empty`` and filled with N(0, 0.02), norms with 1).
The kbit side is built layer by layer (materialise a layer in bf16, quantize it, free the bf16 weights), so
Qwen3-30B-A3B (~61 GB in bf16) and Mixtral-8x7B (~93 GB) never need their bf16 and kbit copies at once: Linear
layers through ``kbit.quantize_model`` (``KbitLinear``), MoE blocks through ``kbit.nn.KbitMoE.from_hf``
(device-side routing, no host sync). Embeddings, norms, routers and ``lm_head`` stay bf16 unless ``--lm-head-k`` is
given.

The loop (``kbit.hf.decode.StaticDecoder``): a transformers ``StaticCache``, an eager prefill of ``--ctx``
random prompt tokens per row, then the decode step (embedding, every layer with attention over the static
cache, final norm, lm_head, argmax, the token written back, position advanced) captured in one CUDA graph
and replayed. Timed: ``--steps`` consecutive steps (CUDA events), rewound to the prompt between repetitions,
median of ``--reps``. tokens/s = batch * steps / time. ``--fuse``: ``kbit.hf.decode.compile_glue`` on both
sides (RMSNorm, rotary, SiLU * up fused by torch.compile; matmuls and attention untouched).
Both sides decode through ``kbit.hf.decode.static_attention`` (the split-KV kernel of ``kbit.ops.attention``
on one-token steps; ``--decode-attention sdpa`` runs SDPA instead, recorded as ``decode_attn`` in the meta).
The bf16 MoE baseline is timed twice, with
transformers' ``experts_implementation="grouped_mm"`` (``bf16``) and with kbit's device-side routing +
``torch._grouped_mm`` on the bf16 stacks (``bf16-kr``, as in bench_moe.py); speedups are against the faster.

One script for the device machine; writes ``e2e.json`` / ``e2e.md`` to ``$OUT`` (default
benchmarks/results/h100/), updated after every row, and prints a short table last.

``--profile``: the step profile of ``kbit.bench.step_profile`` for every bf16 and kbit row (every batch): each
kernel of one decode step with the module it serves, the bytes it must read, its time, bandwidth and the idle gap
before it (a CUDA-graph replay under torch.profiler, kernels named from an eager step), totals against the byte
roofline at the read ceiling (measured once at the start, or ``--ceiling-tbps``); written as
``step-<model>-<variant>[-k<k>]-b<B>.txt`` (table), ``.kernels.txt`` (every kernel in order), ``.json`` and
``.png`` (timeline); all tables also in ``profile.txt``. ``--layers N`` keeps the first N decoder layers of each
model (quick profiles).

    PYTHONUNBUFFERED=1 python benchmarks/bench_e2e.py
        [--models llama3-8b,qwen3-8b,qwen2.5-7b,qwen3-30b-a3b,mixtral-8x7b] [--k 2,3,4,5] [--batch 1,4,16,64]
        [--ctx 512] [--steps 32] [--reps 5] [--profile] [--layers N] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
# this checkout's kbit, unless PYTHONPATH names another tree that has one (an A/B of two trees runs this file with
# PYTHONPATH at each)
if not any((Path(p) / "kbit").is_dir() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
    sys.path.insert(0, str(ROOT / "src"))

from kbit.hf.decode import StaticDecoder, compile_glue  # noqa: E402

ATTN = r"self_attn\.(q|k|v|o)_proj"
DENSE_MLP = r"mlp\.(gate|up|down)_proj"


def configs(tiny: bool = False) -> dict:
    import transformers

    if tiny:  # CPU smoke test of the script itself
        return {
            "llama-tiny": transformers.LlamaConfig(
                hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=96, max_position_embeddings=256),
            "qwen2-tiny": transformers.Qwen2Config(  # q/k/v biases
                hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=96, max_position_embeddings=256),
            "qwen3moe-tiny": transformers.Qwen3MoeConfig(
                hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, vocab_size=96, max_position_embeddings=256),
            "mixtral-tiny": transformers.MixtralConfig(
                hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=96,
                max_position_embeddings=256),
        }
    return {
        "llama3-8b": transformers.LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0),
        "qwen3-8b": transformers.Qwen3Config(
            hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=8192,
            rope_theta=1000000.0, tie_word_embeddings=False),
        # Qwen2.5-7B: q/k/v with biases, 4 KV heads, a 152064-row lm_head (1.09 GB in bf16)
        "qwen2.5-7b": transformers.Qwen2Config(
            hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
            num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
            tie_word_embeddings=False),
        "qwen3-30b-a3b": transformers.Qwen3MoeConfig(
            hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
            num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
            num_experts_per_tok=8, norm_topk_prob=True, vocab_size=151936, max_position_embeddings=8192,
            rope_theta=1000000.0),
        # Mixtral-8x7B-v0.1's config.json (no sliding window)
        "mixtral-8x7b": transformers.MixtralConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
            max_position_embeddings=32768, rope_theta=1000000.0, sliding_window=None),
    }


def with_layers(config, n: int | None):
    """``config`` with its first ``n`` decoder layers only (None: unchanged); per-layer lists are cut to match."""
    if not n:
        return config
    d = config.to_dict()
    d["num_hidden_layers"] = n
    if isinstance(d.get("layer_types"), list):
        d["layer_types"] = d["layer_types"][:n]
    if isinstance(d.get("mlp_only_layers"), list):
        d["mlp_only_layers"] = [i for i in d["mlp_only_layers"] if i < n]
    return type(config).from_dict(d)


def git_commit() -> str:
    if os.environ.get("KBIT_COMMIT"):
        return os.environ["KBIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


# ------------------------------------------------------------------------------------------------ models


def _fill(module: nn.Module, gen: torch.Generator) -> None:
    """Materialised parameters: vectors (norm weights) = 1, matrices ~ N(0, 0.02)."""
    with torch.no_grad():
        for p in module.parameters(recurse=True):
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)


def _materialise(module: nn.Module, device, gen) -> None:
    module.to_empty(device=device, recurse=True)
    _fill(module, gen)


def _fix_rotary(model: nn.Module, device) -> None:
    """Rotary embeddings keep computed, non-persistent buffers: rebuild them on ``device``."""
    for name, m in list(model.named_modules()):
        if type(m).__name__.endswith("RotaryEmbedding"):
            with torch.device(device):
                model.set_submodule(name, type(m)(config=getattr(m, "config", model.config)))


def _skeleton(config, experts_impl: str | None):
    from transformers import AutoModelForCausalLM

    kw = {"dtype": torch.bfloat16}
    if experts_impl is not None and getattr(config, "num_experts", 0):
        kw["experts_implementation"] = experts_impl
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **kw)
    return model.eval()


class Bf16GroupedMoE(nn.Module):
    """A bf16 sparse block on kbit's device-side routing (softmax top-k, ``align``) and ``torch._grouped_mm``
    (the baseline of bench_moe.py), around the weights of a transformers block (shared, not copied)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block
        self.top_k = int(getattr(block, "top_k", None) or block.gate.top_k)
        self.norm = bool(next((o.norm_topk_prob for o in (block, block.gate) if hasattr(o, "norm_topk_prob")),
                              True))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from kbit.ops.moe import combine, silu_mul_gate_up
        from kbit.ops.moe_align import align
        from kbit.ops.moe_router import select_experts

        experts = self.block.experts
        x = hidden.reshape(-1, hidden.shape[-1])
        logits = F.linear(x, self.block.gate.weight)
        w, ids = select_experts(logits, self.top_k, renormalize=self.norm)
        r = align(ids, experts.gate_up_proj.shape[0], w)
        xs = x.index_select(0, r.token_ids)
        gu = torch._grouped_mm(xs, experts.gate_up_proj.transpose(-2, -1), offs=r.offsets)
        y = torch._grouped_mm(silu_mul_gate_up(gu), experts.down_proj.transpose(-2, -1), offs=r.offsets)
        return combine(y, r, x.dtype).reshape(hidden.shape)


def build_bf16(config, device, seed: int = 0, fuse_proj: bool = False):
    model = _skeleton(config, "grouped_mm")
    gen = torch.Generator(device=device).manual_seed(seed)
    _materialise(model, device, gen)
    _fix_rotary(model, device)
    if fuse_proj:
        fuse_projections(model)
    return model


def moe_blocks(model) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("SparseMoeBlock")]


def set_bf16_moe(model, blocks: list, variant: str) -> None:
    """``bf16``: transformers' blocks (grouped_mm experts); ``bf16-kr``: :class:`Bf16GroupedMoE` around them."""
    for name, block in blocks:
        model.set_submodule(name, block if variant == "bf16" else Bf16GroupedMoE(block))


def build_kbit(config, device, k: int, seed: int = 0, lm_head_k: int | None = None, fuse_proj: bool = False):
    """The kbit model, quantized one decoder layer at a time (peak: the k-bit model + one bf16 layer)."""
    from kbit.hf import quantize_model
    from kbit.nn import KbitLinear, KbitMoE

    model = _skeleton(config, None)
    gen = torch.Generator(device=device).manual_seed(seed)
    layers = model.model.layers
    for name, m in model.named_children():  # everything but the decoder layers
        if name != "model":
            _materialise(m, device, gen)
    for name, m in model.model.named_children():
        if name != "layers":
            _materialise(m, device, gen)
    _fix_rotary(model, device)
    # fuse_proj: q/k/v and gate/up quantized jointly (quantize_model's default), which the fast decode step runs
    # as one GEMV each (kbit.hf.fast_decode.fuse_group): the library's own path, what a user gets
    for layer in layers:
        _materialise(layer, device, gen)
        for name, block in moe_blocks(layer):
            layer.set_submodule(name, KbitMoE.from_hf(block, k=k))
        quantize_model(layer, k=k, include=[ATTN, DENSE_MLP], progress=False, joint=fuse_proj)
        if device != "cpu":
            torch.cuda.empty_cache()
    if lm_head_k is not None:
        model.lm_head = KbitLinear.from_linear(model.lm_head, k=lm_head_k)
    return model


class _Part(nn.Module):
    """One projection of a fused Linear: the first part computes the fused product for its input, the others
    slice it when called on the same input tensor (transformers calls q, k, v -- and gate, up -- in order on
    one tensor); any other input recomputes. The last part drops the stored product (holding it kept every
    layer's prefill output alive: out of memory at batch 64 in the first H100 run)."""

    def __init__(self, owner: dict, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.owner, self.lo, self.hi = owner, lo, hi  # owner: a plain dict, not a submodule
        self.first, self.last = first, last

    def forward(self, x):
        o = self.owner
        if self.first or o.get("x") is not x:
            o["x"], o["y"] = x, o["linear"](x)
        y = o["y"][..., self.lo:self.hi]
        if self.last:
            o.pop("x", None)
            o.pop("y", None)
        return y


def fuse_projections(model) -> int:
    """Concatenate q/k/v and gate/up Linear weights of every decoder layer into one Linear each (``qkv_proj``,
    ``gate_up_proj``; the old names become slices of it), before quantization, so a decode step runs 4 matrix
    products a layer instead of 7. Returns how many groups were fused. The bf16 side of ``--fuse-proj``; the kbit
    side gets the same from ``quantize_model(joint=True)`` and the fast decode step (one tensor scale a group)."""
    return sum(fuse_projections_layer(layer) for layer in model.model.layers)


def fuse_projections_layer(layer) -> int:
    """:func:`fuse_projections` of one decoder layer."""
    done = 0
    for parent, names, fused_name in ((layer.self_attn, ("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                                      (getattr(layer, "mlp", None), ("gate_proj", "up_proj"), "gate_up_proj")):
        mods = [getattr(parent, n, None) for n in names]
        if not all(isinstance(m, nn.Linear) and type(m) is nn.Linear for m in mods):
            continue
        w = torch.cat([m.weight.detach() for m in mods])
        bias = None if mods[0].bias is None else torch.cat([m.bias.detach() for m in mods])
        fused = nn.Linear(w.shape[1], w.shape[0], bias=bias is not None, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            fused.weight.copy_(w)
            if bias is not None:
                fused.bias.copy_(bias)
        setattr(parent, fused_name, fused)
        owner, lo = {"linear": fused}, 0
        for i, (n, m) in enumerate(zip(names, mods, strict=True)):
            setattr(parent, n, _Part(owner, lo, lo + m.out_features, first=i == 0, last=i == len(names) - 1))
            lo += m.out_features
        parent._kbit_fused_owner = owner  # keeps the owner reachable (tests check it holds no product)
        del w, mods
        done += 1
    return done


def weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


# ------------------------------------------------------------------------------------------------ timing


DECODE_ATTN = ["auto"]  # StaticDecoder's decode attention (--decode-attention)
FAST = [None]  # StaticDecoder's fast decode step: None = its default (on CUDA when supported), False = --no-fast


def time_decode(model, batch: int, ctx: int, steps: int, reps: int, graph: bool, seed: int = 0,
                eager_steps: int = 0, profile: dict | None = None) -> dict:
    """One row: ms per decode step (CUDA events around ``steps`` graph replays, median of ``reps``); with
    ``profile`` (:func:`step_profile_files`' keywords) also the step profile."""
    dev = next(model.parameters()).device
    vocab = model.config.vocab_size
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)  # max_mem_gb: the model + this batch's cache, graph, prefill
    dec = StaticDecoder(model, batch, ctx + steps + 8, graph=graph, fast=FAST[0], decode_attention=DECODE_ATTN[0])
    gen = torch.Generator(device=dev).manual_seed(seed)
    prompt = torch.randint(0, vocab, (batch, ctx), device=dev, generator=gen)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    dec.prefill(prompt)
    sync()
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    if graph:
        dec.capture()
    dec.step()  # one step (in graph mode: the first replay)
    sync()
    capture_s = time.perf_counter() - t0
    finite = bool(torch.isfinite(dec.logits).all())
    times = []
    for _ in range(reps):
        dec.rewind(ctx)
        sync()
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                dec.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                dec.step()
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    row = {"batch": batch, "ctx": ctx, "steps": steps, "reps": reps, "graph": graph,
           "ms_per_step": 1e3 * med / steps, "ms_per_step_min": 1e3 * min(times) / steps,
           "ms_per_step_max": 1e3 * max(times) / steps, "tokens_per_s": batch * steps / med,
           "prefill_s": prefill_s, "capture_s": capture_s, "logits_finite": finite}
    if eager_steps:  # the same step without the graph, for the notes (launch overhead)
        dec.rewind(ctx)
        dec._step_body()
        sync()
        t0 = time.perf_counter()
        for _ in range(eager_steps):
            dec._step_body()
        sync()
        row["eager_ms_per_step"] = 1e3 * (time.perf_counter() - t0) / eager_steps
    if profile is not None:
        try:
            row["profile"] = step_profile_files(dec, ctx, row, **profile)
        except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
            traceback.print_exc()
            row["profile_error"] = f"{type(e).__name__}: {e}"
    if dev.type == "cuda":
        row["max_mem_gb"] = torch.cuda.max_memory_allocated(dev) / 2**30
    dec.release()
    del dec
    return row


DEFAULT_CEILING_TBPS = 3.07  # H100 read ceiling (kbit.bench.ceiling, issue 36): used only where none is measured
CEILING: dict = {}  # the read ceiling of this run, measured once


def read_ceiling(given: float | None, device: str) -> tuple[float, str]:
    """(TB/s, how it was obtained): ``given``, else measured once (kbit.bench.ceiling), else the default."""
    if given:
        return float(given), "given with --ceiling-tbps"
    if "tbps" not in CEILING:
        CEILING["tbps"], CEILING["how"] = DEFAULT_CEILING_TBPS, "assumed: no GPU"
        if device == "cuda":
            try:
                from kbit.bench.ceiling import measure_read_ceiling  # a benchmark-only helper of the package

                CEILING["tbps"], CEILING["how"] = measure_read_ceiling().read_tbps, "measured: x.sum() over 2 GiB"
            except Exception as e:  # noqa: BLE001 (the profile still runs, on the default, and says so)
                CEILING["how"] = f"assumed: measuring failed ({type(e).__name__})"
    return CEILING["tbps"], CEILING["how"]


PROFILE_EAGER = [False]  # --profile-eager: the eager step's timeline, no graph replay under the profiler


def step_profile_files(dec: StaticDecoder, ctx: int, row: dict, stem: Path, title: str,
                       ceiling: tuple[float, str]) -> str:
    """The step profile of ``dec`` (kbit.bench.step_profile) written to ``stem``.txt / .json / .png; returns the
    table. The roofline % is taken against the row's unprofiled graph step time."""
    from kbit.bench.step_profile import profile_decoder
    from kbit.bench.step_report import format_kernels, format_report, plot_timeline, to_dict

    graph = row.get("graph") and dec.graph
    meta = {"title": title, "ceiling_source": ceiling[1],
            "step_source": "CUDA-graph replay, CUDA events, unprofiled" if graph else "profiled span",
            "eager_ms": row.get("eager_ms_per_step")}
    prof = profile_decoder(dec, ctx, ceiling_tbps=ceiling[0], step_ms=row["ms_per_step"] if graph else None,
                           meta=meta, graph=not PROFILE_EAGER[0])
    text = format_report(prof)
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.txt").write_text(text + "\n")
    Path(f"{stem}.json").write_text(json.dumps(to_dict(prof), indent=1) + "\n")
    Path(f"{stem}.kernels.txt").write_text(format_kernels(prof) + "\n")
    try:
        plot_timeline(prof, f"{stem}.png")
    except Exception as e:  # noqa: BLE001 (matplotlib is optional; the table and JSON are written already)
        text += f"\n(no timeline plot: {type(e).__name__}: {e})"
    return text


# ------------------------------------------------------------------------------------------------ report


def markdown(meta: dict, rows: list) -> str:
    lines = [f"# End-to-end decode, bf16 vs kbit ({meta['device']}, {meta['date']})", "",
             f"commit {meta['commit']}, torch {meta['torch']}, triton {meta['triton']}, transformers "
             f"{meta['transformers']}; `{meta['command']}`", "",
             f"Context {meta['ctx']} prompt tokens per row, {meta['steps']} decode steps per repetition, median "
             f"of {meta['reps']}; CUDA graph of one whole decode step (attention, lm_head, argmax included) on "
             "both sides; glue fused by torch.compile (compile_glue) on both sides: "
             f"{'yes' if meta.get('fuse') else 'no'}; decode steps through kbit's fast step (fused glue kernels, "
             f"kbit.hf.fast_decode) on both sides: {'yes' if meta.get('fast_decode') else 'no'}. Speedup: against "
             "the faster bf16 variant of the same model and batch.", "",
             "| model | variant | k | batch | ms/step | tokens/s | speedup | eager ms/step | max mem GB |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    best = best_bf16(rows)
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['variant']} | {r.get('k', '')} | {r.get('batch', '')} | "
                         f"error: {r['error'][:80]} | | | | |")
            continue
        b = best.get((r["model"], r["batch"]))
        sp = f"{r['tokens_per_s'] / b:.2f}x" if b else ""
        eager = f"{r['eager_ms_per_step']:.2f}" if "eager_ms_per_step" in r else ""
        lines.append(f"| {r['model']} | {r['variant']} | {r.get('k') or ''} | {r['batch']} | "
                     f"{r['ms_per_step']:.3f} | {r['tokens_per_s']:.1f} | {sp} | {eager} | "
                     f"{r.get('max_mem_gb', 0):.1f} |")
    lines += ["", "```", short_table(rows), "```", ""]
    profiles = [r for r in rows if r.get("profile")]
    for r in profiles:
        lines += [f"## Step profile: {r['model']} {r['variant']} k={r.get('k')} batch {r['batch']}",
                  "", "```", r["profile"], "```", ""]
    return "\n".join(lines)


def best_bf16(rows: list) -> dict:
    best: dict = {}
    for r in rows:
        if r.get("variant", "").startswith("bf16") and "tokens_per_s" in r:
            key = (r["model"], r["batch"])
            best[key] = max(best.get(key, 0.0), r["tokens_per_s"])
    return best


def short_table(rows: list) -> str:
    best = best_bf16(rows)
    ks = sorted({r["k"] for r in rows if r.get("variant") == "kbit" and "tokens_per_s" in r})
    out = [f"{'model':16s} {'B':>3s} {'bf16 tok/s':>11s} " + " ".join(f"{'k=' + str(k):>16s}" for k in ks)]
    for model, batch in sorted(best, key=lambda x: (x[0], x[1])):
        cells = []
        for k in ks:
            r = next((r for r in rows if r.get("variant") == "kbit" and r.get("k") == k and r["model"] == model
                      and r.get("batch") == batch and "tokens_per_s" in r), None)
            cells.append(f"{r['tokens_per_s']:9.1f} ({r['tokens_per_s'] / best[(model, batch)]:.2f}x)"
                         if r else f"{'-':>16s}")
        out.append(f"{model:16s} {batch:3d} {best[(model, batch)]:11.1f} " + " ".join(f"{c:>16s}" for c in cells))
    for r in rows:
        if r.get("variant", "").startswith("kbit+") and "tokens_per_s" in r and (r["model"], r["batch"]) in best:
            out.append(f"{r['model']:16s} {r['batch']:3d} {r['variant']} k={r['k']}: {r['tokens_per_s']:.1f} tok/s "
                       f"({r['tokens_per_s'] / best[(r['model'], r['batch'])]:.2f}x)")
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ main


def run(args) -> list:
    out_dir = Path(args.out or os.environ.get("OUT") or ROOT / "benchmarks" / "results" / "h100")
    out_dir.mkdir(parents=True, exist_ok=True)
    device = args.device
    graph = device == "cuda" and not args.no_graph
    cfgs = configs(args.tiny)
    models = args.models.split(",") if args.models else list(cfgs)
    import transformers
    import triton

    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("KBIT_") and k != "KBIT_COMMIT")
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "date": datetime.date.today().isoformat(), "commit": git_commit(), "torch": torch.__version__,
            "triton": triton.__version__, "transformers": transformers.__version__,
            "command": (env + " " if env else "") + "python benchmarks/bench_e2e.py " + " ".join(args.argv),
            "ctx": args.ctx,
            "steps": args.steps, "reps": args.reps, "graph": graph, "fuse": args.fuse, "fuse_proj": args.fuse_proj,
            "lm_head_k": args.lm_head_k, "decode_attn": args.decode_attention,
            "fast_decode": not args.no_fast}
    FAST[0] = False if args.no_fast else None
    PROFILE_EAGER[0] = args.profile_eager
    DECODE_ATTN[0] = args.decode_attention
    rows: list = []
    json_path = out_dir / f"{args.name}.json"
    if args.append and json_path.exists():  # one results file for several invocations
        old = json.loads(json_path.read_text())
        rows = old["rows"]
        meta["command"] = old["meta"]["command"] + " ; " + meta["command"]

    def save():
        (out_dir / f"{args.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        (out_dir / f"{args.name}.md").write_text(markdown(meta, rows))

    def measure(model, name, variant, k, extra=None):
        for b in args.batch:
            t0 = time.perf_counter()
            try:
                prof = None
                if args.profile and variant in ("bf16", "kbit"):
                    stem = out_dir / f"step-{name}-{variant}{f'-k{k}' if k else ''}-b{b}"
                    prof = {"stem": stem, "title": f"{name} {variant}{f' k={k}' if k else ''} B={b} ctx={args.ctx} "
                            f"({meta['device']}, commit {meta['commit']})",
                            "ceiling": read_ceiling(args.ceiling_tbps, device)}
                row = time_decode(model, b, args.ctx, args.steps, args.reps, graph,
                                  eager_steps=args.eager_steps if b == 1 else 0, profile=prof)
            except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
                traceback.print_exc()
                row = {"batch": b, "error": f"{type(e).__name__}: {e}"}
            row = {"model": name, "variant": variant, "k": k, "fuse": args.fuse, "fuse_proj": args.fuse_proj,
                   **(extra or {}), **row}
            rows.append(row)
            save()
            msg = row.get("error") or (f"{row['ms_per_step']:.3f} ms/step {row['tokens_per_s']:.1f} tok/s "
                                       f"(eager {row.get('eager_ms_per_step', float('nan')):.2f} ms)")
            print(f"[{name} {variant} k={k} B={b}] {msg} [{time.perf_counter() - t0:.1f} s]", flush=True)
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()

    if args.profile:
        meta["ceiling_tbps"], meta["ceiling"] = read_ceiling(args.ceiling_tbps, device)  # before any model
        meta["layers"] = args.layers
    for name in models:
        config = with_layers(cfgs[name], args.layers)
        if not args.skip_bf16:
            t0 = time.perf_counter()
            try:
                model = build_bf16(config, device, fuse_proj=args.fuse_proj)
                if args.fuse:
                    compile_glue(model)
                wb = weight_bytes(model)
                print(f"[{name}] bf16 built: {wb / 2**30:.1f} GiB in {time.perf_counter() - t0:.1f} s", flush=True)
                blocks = moe_blocks(model)
                variants = ["bf16", "bf16-kr"] if blocks and not args.no_kr else ["bf16"]
                for v in variants:
                    set_bf16_moe(model, blocks, v)
                    measure(model, name, v, None, {"weights_gib": wb / 2**30})
                del model, blocks
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.append({"model": name, "variant": "bf16", "error": f"{type(e).__name__}: {e}"})
                save()
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        for k in args.k:
            t0 = time.perf_counter()
            try:
                model = build_kbit(config, device, k, lm_head_k=args.lm_head_k, fuse_proj=args.fuse_proj)
                if args.fuse:
                    compile_glue(model)
                wb = weight_bytes(model)
                print(f"[{name}] k={k} built: {wb / 2**30:.2f} GiB in {time.perf_counter() - t0:.1f} s", flush=True)
                variant = "kbit" if args.lm_head_k is None else f"kbit+head{args.lm_head_k}"
                measure(model, name, variant, k, {"weights_gib": wb / 2**30, "lm_head_k": args.lm_head_k})
                del model
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                rows.append({"model": name, "variant": "kbit", "k": k, "error": f"{type(e).__name__}: {e}"})
                save()
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
    save()
    if args.profile:
        (out_dir / "profile.txt").write_text("\n\n".join(
            f"{r['model']} {r['variant']} k={r.get('k')} B={r['batch']}\n{r['profile']}"
            for r in rows if r.get("profile")))
    print(f"decode tokens/s ({meta['device']}, ctx {args.ctx}, CUDA graph: {graph}, fused glue: {args.fuse}; "
          "x = vs the faster bf16)")
    print(short_table(rows))
    return rows


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=None, help="comma-separated (default: all)")
    p.add_argument("--k", default="2,3,4,5")
    p.add_argument("--batch", default="1,4,16,64")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--eager-steps", type=int, default=4, help="also time N eager steps at batch 1")
    p.add_argument("--lm-head-k", type=int, default=None, help="quantize lm_head too, at this k")
    p.add_argument("--skip-bf16", action="store_true")
    p.add_argument("--no-kr", action="store_true", help="MoE: time only transformers' grouped_mm bf16 baseline")
    p.add_argument("--fuse", action="store_true", help="compile_glue (torch.compile of norms, rotary, SiLU*up)")
    p.add_argument("--fuse-proj", action="store_true",
                   help="one matrix product for q/k/v and one for gate/up on both sides (bf16: fused Linear; kbit: "
                   "joint quantization, fused by the fast decode step)")
    p.add_argument("--profile", action="store_true",
                   help="step profile of the bf16 and kbit rows (kbit.bench.step_profile): table, JSON, timeline")
    p.add_argument("--ceiling-tbps", type=float, default=None,
                   help="read ceiling for the profile's roofline (default: measured once)")
    p.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers of each model")
    p.add_argument("--profile-eager", action="store_true",
                   help="profile timeline from the eager step (no CUDA-graph replay under the profiler)")
    p.add_argument("--quick", action="store_true", help="k = 4, batch 1 and 16, 16 steps, 3 reps")
    p.add_argument("--tiny", action="store_true", help="tiny configs (CPU smoke test of the script)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-graph", action="store_true")
    p.add_argument("--no-fast", action="store_true", help="decode steps through transformers' forward (A/B)")
    p.add_argument("--decode-attention", default="auto", choices=("auto", "kbit", "sdpa"),
                   help="attention of one-token steps (StaticDecoder's decode_attention)")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="e2e")
    p.add_argument("--append", action="store_true", help="add the rows to an existing NAME.json")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.quick:
        args.k, args.batch, args.steps, args.reps = "4", "1,16", 16, 3
    args.k = [int(x) for x in str(args.k).split(",") if x]
    args.batch = [int(x) for x in str(args.batch).split(",") if x]
    return args


def main(argv=None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
