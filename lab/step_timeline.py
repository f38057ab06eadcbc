"""Where the time of one decode step goes: kernel durations and the gaps between them in a CUDA-graph replay.

Builds the random-initialised models of ``benchmarks/bench_e2e.py`` (same options), captures the decode step,
times graph replays, profiles one eager step with the torch profiler (kernel durations; CUPTI records no kernels
inside graph replays here) and prints, per kernel family, the count and the summed duration, beside the graph step.

    python lab/step_timeline.py --models llama3-8b --k bf16,4,2 --fuse --fuse-proj [--out DIR]

``--env "KBIT_FUSE_PROLOGUE=0;..."``: also time the graph step captured with those environment variables.
``--ablate norm,rope,attn,silu,glue``: also time the graph step with that part of the fast step replaced by no
kernel at all (wrong logits, timing only): the step's saving is what the part costs on the critical path.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

FAMILIES = [  # (family, regex on the kernel name), first match wins
    ("kbit gemv", r"kbit_gemv|kbit_gemv_mma"),
    ("kbit x tiles", r"kbit_x_tiles"),
    ("attention", r"attn|attention|sdpa|flash|fmha"),
    ("cublas gemm", r"nvjet|gemm|cutlass|splitKreduce"),
    ("rms norm", r"rsqrt|rms|norm"),
    ("rotary", r"cat_mul_neg|rotary|rope"),
    ("silu*up", r"silu"),
    ("kv write", r"index_elementwise|index_copy|scatter"),
    ("argmax/sample", r"argmax|reduce_kernel|sample|topk"),
    ("elementwise", r"elementwise|triton_poi|copy"),
]


def family(name: str) -> str:
    for fam, pat in FAMILIES:
        if re.search(pat, name, re.I):
            return fam
    return "other"


def kernels_of_step(dec):
    """Kernels of one eager decode step (CUPTI records no kernels inside graph replays here): (name, start, end)."""
    from torch.profiler import ProfilerActivity, profile

    n0 = dec.length
    dec._step_body()
    torch.cuda.synchronize()
    dec.rewind(n0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec._step_body()
        torch.cuda.synchronize()
    dec.rewind(n0)
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ker = [(e.name, e.time_range.start, e.time_range.end) for e in ev
           if not e.name.startswith("Memcpy") and not e.name.startswith("Memset")]
    ker.sort(key=lambda t: t[1])
    return ker


def graph_step_us(dec, steps: int = 20) -> float:
    n0 = dec.length
    for _ in range(3):
        dec.step()
    dec.rewind(n0)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        dec.step()
    b.record()
    b.synchronize()
    dec.rewind(n0)
    return a.elapsed_time(b) * 1e3 / steps


def summarise(step):
    fam = defaultdict(lambda: [0, 0.0, 0.0])
    gemv_i = 0
    for i, (name, t0, t1) in enumerate(step):
        f = family(name)
        if f == "kbit gemv":
            f = f"kbit gemv #{gemv_i % 4}"
            gemv_i += 1
        gap = t0 - step[i - 1][2] if i else 0.0
        fam[f][0] += 1
        fam[f][1] += t1 - t0
        fam[f][2] += max(gap, 0.0)
    total = step[-1][2] - step[0][1]
    return dict(fam), total


ABLATIONS = ("norm", "rope", "attn", "attn-tiny", "silu", "glue")


def ablate(part: str):
    """Patch :mod:`kbit.hf.fast_decode` so that ``part`` launches nothing; returns an undo function."""
    import kbit.hf.fast_decode as fd

    saved = {n: getattr(fd, n) for n in ("rms_norm", "add_rms_norm", "rope_append", "silu_mul",
                                         "add_rms_norm_linear")}
    saved_attend = fd.FastDecodeStep._attend
    parts = {"norm", "rope", "attn", "silu"} if part == "glue" else {part}
    if "norm" in parts:
        fd.rms_norm = lambda x, w, eps: x
        fd.add_rms_norm = lambda x, res, w, eps: (x, res)
        # the fused prologue path: the projection alone (with silu_mul, its first half: SiLU * up goes too)
        fd.add_rms_norm_linear = lambda x, res, w, eps, lin, silu_mul=False: (
            lin(x)[:, :lin.out_features // 2] if silu_mul else lin(x), res)
    if "rope" in parts:
        fd.rope_append = lambda q, k, v, cos, sin, pos, kc, vc, *a, **kw: q.unflatten(-1, (-1, kc.shape[-1]))
    if "attn" in parts:
        fd.FastDecodeStep._attend = lambda self, q, kc, vc, length, scale, pos: q
    if "attn-tiny" in parts:  # the attention replaced by one tiny glue kernel (cost of any launch in its place)
        fd.FastDecodeStep._attend = lambda self, q, kc, vc, length, scale, pos: saved["silu_mul"](
            q.flatten(1), q.flatten(1)).view(q.shape)
    if "silu" in parts:
        fd.silu_mul = lambda g, u: g

    def undo():
        for n, f in saved.items():
            setattr(fd, n, f)
        fd.FastDecodeStep._attend = saved_attend
    return undo


def attn_config(spec: str):
    """Patch :func:`kbit.ops.attention.pick_config` to return ``chunk:block_n:num_warps:num_stages``; returns undo."""
    import kbit.ops.attention as A

    chunk, block_n, warps, stages = (int(v) for v in spec.split(":"))
    saved = A.pick_config
    A.pick_config = lambda *a, **kw: A.DecodeAttentionConfig(chunk, block_n, warps, stages)

    def undo():
        A.pick_config = saved
    return undo


def gemv_config(spec: str):
    """M = 1 GEMVs of the listed ``NxK`` shapes on the given configs (``NxK=1,8,2/NxK=3,8,2,2,1``); returns undo."""
    from kbit.ops import gemv_mma as G

    table = {}
    for item in spec.split("/"):
        shape, cfg = item.split("=")
        n, k = (int(v) for v in shape.split("x"))
        table[(n, k)] = tuple(int(v) for v in cfg.split(","))
    saved = G.default_config

    def patched(k, M, N, K):
        return table.get((N, K)) if M == 1 and (N, K) in table else saved(k, M, N, K)
    G.default_config = patched
    G._PLANS.clear()

    def undo():
        G.default_config = saved
        G._PLANS.clear()
    return undo


def env_setting(spec: str):
    """Set the environment variables of ``NAME=value[,NAME=value]`` for the capture; returns undo."""
    pairs = [item.split("=", 1) for item in spec.split(",")]
    saved = {n: os.environ.get(n) for n, _ in pairs}
    for n, v in pairs:
        os.environ[n] = v

    def undo():
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v
    return undo


def captured(model, args, gen):
    """A StaticDecoder of ``model`` prefilled with a random prompt (from ``gen``), its step captured and run once."""
    from kbit.hf.decode import StaticDecoder

    dec = StaticDecoder(model, args.batch, args.ctx + 64, graph=True)
    dec.prefill(torch.randint(0, model.config.vocab_size, (args.batch, args.ctx), device="cuda", generator=gen))
    dec.capture()
    dec.step()
    return dec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="llama3-8b")
    p.add_argument("--k", default="bf16,4,2")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--fuse", action="store_true")
    p.add_argument("--fuse-proj", action="store_true")
    p.add_argument("--lm-head-k", type=int, default=None)
    p.add_argument("--ablate", default="", help=f"comma list of {ABLATIONS}: graph step without that part")
    p.add_argument("--attn", default="", help="semicolon list of chunk:block_n:num_warps:num_stages attention "
                   "configs: graph step with each instead of pick_config's")
    p.add_argument("--gemv", default="", help="semicolon list of 'NxK=cfg[/NxK=cfg]' M = 1 GEMV configs (cfg as "
                   "KBIT_MMA_CFG, comma-separated): graph step with those shapes on that config")
    p.add_argument("--env", default="", help="semicolon list of 'NAME=value[,NAME=value]': graph step captured "
                   "with those environment variables (e.g. KBIT_FUSE_PROLOGUE=0)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    args = p.parse_args(argv)
    import bench_e2e as be

    from kbit.hf.decode import compile_glue

    cfgs = be.configs()
    report, lines = {}, []
    for name in args.models.split(","):
        for kk in args.k.split(","):
            k = None if kk == "bf16" else int(kk)
            model = (be.build_bf16(cfgs[name], "cuda", fuse_proj=args.fuse_proj) if k is None else
                     be.build_kbit(cfgs[name], "cuda", k, lm_head_k=args.lm_head_k, fuse_proj=args.fuse_proj))
            if args.fuse:
                compile_glue(model)
            gen = torch.Generator(device="cuda").manual_seed(0)
            dec = captured(model, args, gen)
            graph_us = graph_step_us(dec)
            ker = kernels_of_step(dec)
            fams, _ = summarise(ker)
            busy = sum(v[1] for v in fams.values())
            tag = f"{name} {'bf16' if k is None else f'k={k}'} B={args.batch}"
            report[tag] = {"graph_step_us": graph_us, "eager_busy_us": busy, "families": fams,
                           "kernels": [(n, t1 - t0) for n, t0, t1 in ker]}
            lines.append(f"\n{tag}: graph step {graph_us:.1f} us; kernels of an eager step: {len(ker)}, busy "
                         f"{busy:.1f} us; graph step - busy = {graph_us - busy:.1f} us")
            lines.append(f"{'family':<22}{'n':>5}{'busy us':>10}{'avg us':>9}")
            for f, (n, d, _g) in sorted(fams.items(), key=lambda kv: -kv[1][1]):
                lines.append(f"{f:<22}{n:>5}{d:>10.1f}{d / n:>9.2f}")
            dec.release()
            del dec
            variants = [("ablate", a) for a in filter(None, args.ablate.split(","))] + \
                [("attn", a) for a in filter(None, args.attn.split(";"))] + \
                [("gemv", a) for a in filter(None, args.gemv.split(";"))] + \
                [("env", a) for a in filter(None, args.env.split(";"))]
            for kind, part in variants:
                undo = {"ablate": ablate, "attn": attn_config, "gemv": gemv_config, "env": env_setting}[kind](part)
                try:
                    dec = captured(model, args, gen)
                    us = graph_step_us(dec)
                    dec.release()
                    del dec
                finally:
                    undo()
                report[tag].setdefault(kind, {})[part] = us
                what = f"without {part:<6}" if kind == "ablate" else f"{kind} {part:<14}"
                lines.append(f"  {what}: graph step {us:8.1f} us  (saves {graph_us - us:7.1f} us)")
            del model
            torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "step_timeline.json").write_text(json.dumps(report, indent=1))
        (Path(args.out) / "step_timeline.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
