"""GPU lab (issue 36): the decode attention's launch config measured where it runs, in the whole decode step.

    PYTHONUNBUFFERED=1 python lab/attn_chain_sweep.py [--models llama3-8b,qwen3-30b-a3b] [--layers 8]
        [--ctx 512,4096] [--batch 1,16] [--configs 16/16/2/1,...] [--rounds 2] [--out DIR]

The attention of a batch-1 step sits between rope_append and o_proj in a programmatic-dependent-launch chain, so its
cost is what it adds to the step, not its time alone (``kbit.bench.step_profile`` showed 7-9.5 us a layer on an H100 at
context 512 for ~1-2 MB of K/V). For each model (bench_e2e's shapes, the first ``--layers`` decoder layers, k = 4, q/k/v
and gate/up fused) and (batch, context), the step is timed (CUDA graph, bench_e2e's ``time_decode``) with
``kbit.ops.attention.attention_config`` replaced by each fixed config of the sweep, with the shipped rule and with the
rule before d335bfc (``--rules-only``: those two). ``--warps-ab``: instead, the shipped rule and the rule with its 2
warps raised to 4, alternating twice (why it was tried: an unaligned sm_90 build spilled 488 bytes a thread at 2 warps;
as launched it does not, ``lab/attn_sass.py``). ``--fold-ab``: the rule against "attn combine" below, alternating
twice. ``--stubs``: instead, what the attention and rope_append kernels add to
the step, each case twice: the step as shipped; the attention replaced by a kernel that only waits (PDL) and copies q to
its output ("attn stub": a launch and its dependency, none of the work); the attention by no launch at all (its output
left uninitialised: "attn none"); rope_append by no launch ("rope none"); both ("rope+attn none"); the attention's own
grid of programs that only wait, one a head copying q ("attn grid stub": what its CTAs cost by being there). Wrong
results, timing only. Three correct variants too: every key read after the wait ("attn no-prefetch"), the partials
merged by a second launch instead of the last split ("attn combine"), o_proj let launch at the end of each split
program instead of its start ("attn late trigger").
Prints ms a step and us a layer against the rule, a short table last; writes ``attn_chain_sweep.json`` under
``--out`` (default ``$OUT`` or ".")."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# this checkout's kbit, unless PYTHONPATH names another tree that has one (an A/B of two trees runs this file with
# PYTHONPATH at each)
if not any((Path(p) / "kbit").is_dir() for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
    sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_e2e as E  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import kbit.hf.fast_decode as FD  # noqa: E402
import kbit.ops.attention as A  # noqa: E402
from kbit.kernels.glue import _pdl_enter  # noqa: E402
from kbit.ops.pdl import launch_kw  # noqa: E402

SWEEP = [  # (chunk, block_n, num_warps, num_stages)
    (32, 32, 2, 1), (64, 32, 2, 1), (64, 64, 4, 1), (128, 64, 4, 2), (256, 64, 4, 2), (512, 64, 4, 2),
    (128, 32, 2, 2), (256, 128, 8, 2),
]


RULE = A.attention_config


def rule_before(batch_heads, length, head_dim, sms=A.DEFAULT_SMS):
    """``attention_config`` before d335bfc's change (4 programs an SM, no split cap, 64-key blocks past 32)."""
    splits = max(1, (4 * sms) // max(1, batch_heads))
    chunk = -(-length // splits)
    block_n = 32 if head_dim > 128 or chunk <= 32 else 64
    chunk = max(block_n, -(-chunk // block_n) * block_n)
    if chunk == block_n == 32:
        return A.DecodeAttentionConfig(chunk=chunk, block_n=block_n, num_warps=2, num_stages=1)
    return A.DecodeAttentionConfig(chunk=chunk, block_n=block_n)


def rule_w4(*a, **kw):
    """The shipped rule with 4 warps where it gives 2."""
    cfg = RULE(*a, **kw)
    return dataclasses.replace(cfg, num_warps=4) if cfg.num_warps == 2 else cfg


@triton.jit
def _copy_kernel(Q, Out, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _pdl_enter(PDL)
    tl.store(Out + offs, tl.load(Q + offs, mask=offs < n), mask=offs < n)


def attn_stub(query, key, value, **kw):
    """A launch in the attention's place: waits for the previous kernel, copies q to the output."""
    q = query.contiguous()
    out = torch.empty_like(q)
    n = q.numel()
    _copy_kernel[(triton.cdiv(n, 1024),)](q, out, n, BLOCK=1024, **launch_kw(q.device))
    return out


def attn_none(query, key, value, **kw):
    return torch.empty_like(query)


def attn_no_prefetch(query, key, value, **kw):
    """The shipped attention with every key read after the PDL wait (no ``new_from``)."""
    return REAL_ATTN(query, key, value, **{**kw, "new_from": None})


def attn_combine(query, key, value, **kw):
    """The shipped attention with the partials merged by a second launch (no arrival counters)."""
    return REAL_ATTN(query, key, value, **{**kw, "counters": None})


@triton.jit
def _grid_stub_kernel(Q, Out, G, stride_qh, stride_oh, D: tl.constexpr, G_PAD: tl.constexpr, PDL: tl.constexpr):
    bh = tl.program_id(0)
    _pdl_enter(PDL)
    if tl.program_id(1) == 0:
        offs = tl.arange(0, G_PAD)[:, None] * D + tl.arange(0, D)[None, :]
        ok = offs < G * D
        tl.store(Out + bh * stride_oh + offs, tl.load(Q + bh * stride_qh + offs, mask=ok), mask=ok)


def attn_grid_stub(query, key, value, **kw):
    """The attention's grid ((B * Hkv, splits), the rule's warps) of programs that only wait; one a head copies q."""
    B, H, G, D = query.shape
    cfg = RULE(B * H, key.shape[2], D, A.device_sms(query.device))
    q = query.contiguous()
    out = torch.empty_like(q)
    _grid_stub_kernel[(B * H, -(-key.shape[2] // cfg.chunk))](
        q, out, G, G * D, G * D, D=D, G_PAD=max(16, triton.next_power_of_2(G)), num_warps=cfg.num_warps,
        **launch_kw(q.device))
    return out


def _late_trigger_kernels():
    """``kbit.kernels.attention`` with the split kernel's ``gdc_launch_dependents`` moved from its start to its end
    (the next kernel, o_proj, launches only once every split program is done): a module written to a temporary file
    and imported, since Triton reads a kernel's source from its file."""
    import importlib.util
    import inspect
    import tempfile

    src = inspect.getsource(A._k)
    head, tail = src.split("def split_kernel(", 1)
    body, rest = tail.split("\n\n\n@triton.jit\n", 1)  # split_kernel's body: up to the next kernel or helper
    assert body.count("    _pdl_enter(PDL)\n") == 1
    body = body.replace("    _pdl_enter(PDL)\n", "    if PDL:\n        gdc_wait()\n")
    body = body.rstrip("\n") + "\n    if PDL:\n        gdc_launch_dependents()"
    src = (head.replace("from kbit.kernels.glue import ", "from kbit.kernels.glue import gdc_launch_dependents, "
                        "gdc_wait, ", 1)
           + "def split_kernel(" + body + "\n\n\n@triton.jit\n" + rest)
    path = Path(tempfile.mkdtemp()) / "attention_late_trigger.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("attention_late_trigger", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def attn_late_trigger(query, key, value, **kw):
    """The shipped attention whose split programs let o_proj launch at their end instead of their start."""
    global _LATE
    if _LATE is None:
        _LATE = _late_trigger_kernels()
    real = A._k
    A._k = _LATE
    try:
        return REAL_ATTN(query, key, value, **kw)
    finally:
        A._k = real


_LATE = None


def rope_none(q, k, v, cos, sin, pos, k_cache, v_cache, *a, **kw):
    return q.new_empty(q.shape[0], q.shape[1] // k_cache.shape[-1], k_cache.shape[-1])


REAL_ATTN = A.decode_attention
STUBS = {"attn no-prefetch": (None, attn_no_prefetch), "attn combine": (None, attn_combine),
         "attn late trigger": (None, attn_late_trigger), "attn grid stub": (None, attn_grid_stub),
         "attn stub": (None, attn_stub), "attn none": (None, attn_none), "rope none": (rope_none, None),
         "rope+attn none": (rope_none, attn_none)}


def stubbed(rows, args, model, case, label):
    """The step timed with ``STUBS[label]`` in place of rope_append / the attention (or as shipped: "rule")."""
    rope, attn = STUBS.get(label, (None, None))
    real_rope, real_attn = FD.rope_append, A.decode_attention
    FD.rope_append, A.decode_attention = rope or real_rope, attn or real_attn
    try:
        return timed(rows, args, model, case, label, RULE)
    finally:
        FD.rope_append, A.decode_attention = real_rope, real_attn


def timed(rows: list, args, model, case: dict, label: str, fn) -> float | None:
    """One step timing with ``fn`` as the attention's config rule; appends its row, returns ms a step."""
    A.attention_config = fn
    try:
        r = E.time_decode(model, case["batch"], case["ctx"], args.steps, args.reps, graph=not args.tiny)
    except Exception as e:  # noqa: BLE001 (a config may not fit; the sweep goes on)
        print(f"{case} {label}: {type(e).__name__}: {e}", flush=True)
        return None
    finally:
        A.attention_config = RULE
    row = dict(case, config=label, ms=r["ms_per_step"])
    if label == "rule":
        row["rule"] = repr(RULE(case["batch"] * case["kv_heads"], case["ctx"] + args.steps + 8, case["head_dim"],
                                132))
    rows.append(row)
    print(f"{case['model']:14s} b{case['batch']:<3d} ctx{case['ctx']:<5d} {label:22s} {row['ms']:.4f} ms", flush=True)
    return row["ms"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama3-8b,qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--ctx", default="512,4096")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rules-only", action="store_true", help="time the shipped rule and the one before only")
    ap.add_argument("--warps-ab", action="store_true", help="the rule against the rule with 4 warps, alternating")
    ap.add_argument("--stubs", action="store_true",
                    help="the step without the attention's / rope_append's work or launch (timing only)")
    ap.add_argument("--fold-ab", action="store_true",
                    help="the rule against the partials merged by a second launch (\"attn combine\"), alternating")
    ap.add_argument("--configs", default="",
                    help="chunk/block_n/warps/stages,... in place of the fixed sweep (and without \"rule before\")")
    ap.add_argument("--rounds", type=int, default=1, help="times the rule and the sweep are timed, in turn")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test of the script (tiny configs, no graph)")
    args = ap.parse_args()
    sweep = [tuple(map(int, c.split("/"))) for c in args.configs.split(",")] if args.configs else SWEEP
    dev = "cpu" if args.tiny else "cuda"
    cfgs = E.configs(tiny=args.tiny)
    rows: list = []
    for name in args.models.split(","):
        config = E.with_layers(cfgs[name], args.layers)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        model = E.build_kbit(config, dev, 4, fuse_proj=True)
        for ctx in map(int, args.ctx.split(",")):
            for batch in map(int, args.batch.split(",")):
                case = dict(model=name, batch=batch, ctx=ctx, kv_heads=config.num_key_value_heads, head_dim=head_dim)
                if args.stubs or args.fold_ab:
                    labels = ("rule", *STUBS) if args.stubs else ("rule", "attn combine")
                    for label in labels * 2:
                        ms = stubbed(rows, args, model, case, label)
                        if label == "rule":
                            base = ms
                        elif ms is not None and base:
                            rows[-1]["us_per_layer_vs_rule"] = 1e3 * (ms - base) / args.layers
                    continue
                if args.warps_ab:
                    for label, fn in (("rule", RULE), ("rule w4", rule_w4)) * 2:
                        ms = timed(rows, args, model, case, label, fn)
                        if label == "rule":
                            base = ms
                        elif ms is not None and base:
                            rows[-1]["us_per_layer_vs_rule"] = 1e3 * (ms - base) / args.layers
                    continue
                for _ in range(args.rounds):
                    base = timed(rows, args, model, case, "rule", RULE)
                    if not args.configs:
                        ms = timed(rows, args, model, case, "rule before", rule_before)
                        if ms is not None and base:
                            rows[-1]["us_per_layer_vs_rule"] = 1e3 * (ms - base) / args.layers
                    for chunk, bn, w, st in [] if args.rules_only else sweep:
                        cfg = A.DecodeAttentionConfig(chunk=chunk, block_n=bn, num_warps=w, num_stages=st)
                        ms = timed(rows, args, model, case, f"c{chunk}/b{bn}/w{w}/s{st}", lambda *a, c=cfg: c)
                        if ms is not None and base:
                            rows[-1]["us_per_layer_vs_rule"] = 1e3 * (ms - base) / args.layers
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name() if dev == "cuda" else "cpu",
                commit=os.environ.get("KBIT_COMMIT", E.git_commit()), layers=args.layers, steps=args.steps,
                reps=args.reps)
    (out / "attn_chain_sweep.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"\n{meta}\nmodel          batch ctx   config                  ms/step  us/layer vs rule")
    for r in rows:
        d = r.get("us_per_layer_vs_rule")
        print(f"{r['model']:14s} {r['batch']:<5d} {r['ctx']:<5d} {r['config']:22s} {r['ms']:.4f}  "
              f"{'' if d is None else f'{d:+.2f}'} {r.get('rule', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
