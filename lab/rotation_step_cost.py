"""GPU lab (issue 35): what the online rotation costs where the fast decode step fuses it into the kernels that
produce x (kbit.ops.glue's residual add + RMSNorm and SiLU * up with ``rotation=``; o_proj's input through a
standalone ``kbit.ops.hadamard.rotate``). The bars: <= 3% of the batch-1 decode step, <= 5% at M = 1024.

1. The decode step (``kbit.hf.decode.StaticDecoder``, its fast step in one CUDA graph, batch 1, ``--ctx`` cached
   positions): a Llama-3-8B-shaped model (random weights, k = 3, ``--layers`` decoder layers, q/k/v and gate/up
   quantized jointly: one GEMV each), unrotated and with every projection rotated (q/k/v share one rotation,
   gate/up one, o_proj and down_proj one each). Timed alternately (unrotated, rotated, twice); the added time a
   layer is also given as a fraction of a 32-layer step extrapolated from the unrotated one.
2. A decoder layer's parts at M = 1 (cold-L2 weight copies) and M = 1024: each input's producer + layer(s),
   unrotated (today's step: kernel 3's norm prologue / SiLU epilogue where they run) against rotated (the norm /
   SiLU * up kernel rotating its row, and rotate + o_proj): attention input (add + norm, q/k/v), o_proj, MLP
   (add + norm, gate/up, SiLU * up, down), and rotate() + layer as the unfused alternative.

The weights are not rotated: a layer's speed does not depend on their values. Before KbitLinear carries a rotation
itself (``rotation`` / ``forward_rotated``), the rotated layers are stand-ins: the same k-bit layer with those two
attributes (``forward_rotated`` is its plain forward, on an input that is ``x R``).

    PYTHONPATH=src python lab/rotation_step_cost.py [--layers 32] [--k 3] [--ctx 512] [--quick] [--profile]
        [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_e2e  # noqa: E402
import torch  # noqa: E402

from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402
from kbit.dispatch.prologue import add_rms_norm_linear  # noqa: E402
from kbit.format import Rotation  # noqa: E402
from kbit.nn import KbitLinear  # noqa: E402
from kbit.ops.glue import add_rms_norm, silu_mul  # noqa: E402
from kbit.ops.hadamard import rotate, rotation_signs  # noqa: E402

LINES: list = []
SEEDS = {"self_attn.q_proj": 1, "self_attn.k_proj": 1, "self_attn.v_proj": 1, "self_attn.o_proj": 2,
         "mlp.gate_proj": 3, "mlp.up_proj": 3, "mlp.down_proj": 4}
H, I, NQKV = 4096, 14336, 6144  # Llama-3-8B: hidden, intermediate, q + k + v rows


def log(s=""):
    print(s, flush=True)
    LINES.append(s)


# ------------------------------------------------------------------------------------------ 1. the decode step
def rotated_copy(lin: KbitLinear, rot: Rotation) -> KbitLinear:
    """``lin``'s weight (shared tensors) as a layer quantized under ``rot``: KbitLinear's own rotated layer where
    it has one, else the stand-in described in the module doc."""
    m = KbitLinear.from_weight(dataclasses.replace(lin.weight(), rotation=rot), bias=lin.bias, dtype=lin.dtype)
    if getattr(m, "rotation", None) != rot or not hasattr(m, "forward_rotated"):
        m.rotation, m.forward_rotated = rot, m.forward
        m.forward = lambda x, m=m, rot=rot: m.forward_rotated(rotate(x, rot))
    return m


def module_sets(model):
    """``(plain, rotated)``: {(layer index, name): module} for every projection of SEEDS."""
    plain, rot = {}, {}
    for i, layer in enumerate(model.model.layers):
        for name, seed in SEEDS.items():
            lin = layer.get_submodule(name)
            plain[(i, name)] = lin
            rot[(i, name)] = rotated_copy(lin, Rotation.for_width(lin.in_features, seed))
    return plain, rot


def use(model, mods):
    for (i, name), m in mods.items():
        model.model.layers[i].set_submodule(name, m)


def decode_step(args):
    config = bench_e2e.configs()["llama3-8b"]
    config.num_hidden_layers = args.layers
    model = bench_e2e.build_kbit(config, "cuda", k=args.k, fuse_proj=True)
    plain, rot = module_sets(model)  # before any decoder repacks (weight() reads the canonical layout)
    # quantize_model(rotation="residual"): the residual stream rotated offline, only down_proj rotated online
    residual = {key: (rot if key[1] == "mlp.down_proj" else plain)[key] for key in plain}
    times, profiles = {"unrotated": [], "rotated": [], "residual": []}, {}
    for rnd in range(2):
        for name, mods in (("unrotated", plain), ("rotated", rot), ("residual", residual)):
            use(model, mods)
            prof = None
            if args.profile and rnd == 1 and args.out:  # kbit.bench.step_profile's table, files beside the log
                prof = dict(stem=Path(args.out) / f"step-{name}", title=f"{name} llama3-8b k={args.k} b1",
                            ceiling=(3.07, "assumed H100 read ceiling"))
            row = bench_e2e.time_decode(model, 1, args.ctx, args.steps, args.reps, graph=True, profile=prof)
            times[name].append(row["ms_per_step"])
            log(f"| {name} | {row['ms_per_step']:.4f} | {row['ms_per_step_min']:.4f} | {row['ms_per_step_max']:.4f} "
                f"| {row['logits_finite']} |")
            if "profile" in row:
                profiles[name] = row["profile"]
            torch.cuda.empty_cache()
    for name, text in profiles.items():
        log(f"\n### top kernels of one eager {name} step\n\n```\n{text}\n```\n")
    u, r = statistics.median(times["unrotated"]), statistics.median(times["rotated"])
    per_layer = (r - u) / args.layers
    log(f"\nstep: unrotated {u:.4f} ms, rotated {r:.4f} ms: {1e3 * (r - u):+.1f} us ({100 * (r - u) / u:+.2f}%); "
        f"{1e3 * per_layer:+.2f} us a layer")
    res = statistics.median(times["residual"])
    log(f"step: residual (only down_proj rotated online) {res:.4f} ms: {1e3 * (res - u):+.1f} us "
        f"({100 * (res - u) / u:+.2f}%); {1e3 * (res - u) / args.layers:+.2f} us a layer")
    if args.layers != 32:  # the step also reads lm_head (1 GB in bf16): scale the added time, not the fraction
        log(f"a 32-layer step would add {1e3 * 32 * per_layer:.1f} us: divide by bench_e2e's llama3-8b k = {args.k} "
            "batch-1 step for the fraction")
    return u, r


# ------------------------------------------------------------------------------------------ 2. the parts
def _layers(N, K, k, copies):
    out = []
    for _ in range(copies):
        lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
        out.append(KbitLinear.from_linear(lin, k=k).repack_for_kernels())
        del lin
    return out


def parts(M, k, copies_for):
    """{part: (unrotated us, rotated us, rotate() + layer us)} for the decoder layer's parts at M rows."""
    dt, dev = torch.bfloat16, "cuda"
    x, res = torch.randn(M, H, device=dev, dtype=dt), torch.randn(M, H, device=dev, dtype=dt)
    nw = 1 + 0.1 * torch.randn(H, device=dev, dtype=dt)
    o_in = torch.randn(M, H, device=dev, dtype=dt)
    g, u = torch.randn(M, I, device=dev, dtype=dt), torch.randn(M, I, device=dev, dtype=dt)
    rh, rh2, ri = Rotation.for_width(H, 1), Rotation.for_width(H, 2), Rotation.for_width(I, 4)
    sh, sh2, si = rotation_signs(rh, H, x.device), rotation_signs(rh2, H, x.device), rotation_signs(ri, I, x.device)
    qkv = _layers(NQKV, H, k, copies_for(NQKV, H))
    o = _layers(H, H, k, copies_for(H, H))
    gu = _layers(2 * I, H, k, copies_for(2 * I, H))
    down = _layers(H, I, k, copies_for(H, I))
    n = max(len(gu), len(down))
    mlp = [(gu[j % len(gu)], down[j % len(down)]) for j in range(n)]
    cases = {
        "attention input": (
            [lambda q=q: add_rms_norm_linear(x, res, nw, 1e-5, q) for q in qkv],
            [lambda q=q: q(add_rms_norm(x, res, nw, 1e-5, rh, sh)[0]) for q in qkv],
            [lambda q=q: q(rotate(add_rms_norm(x, res, nw, 1e-5)[0], rh, sh)) for q in qkv]),
        "o_proj": (
            [lambda q=q: q(o_in) for q in o],
            [lambda q=q: q(rotate(o_in, rh2, sh2)) for q in o],
            [lambda q=q: q(rotate(o_in, rh2, sh2)) for q in o]),
        "MLP": (
            [lambda a=a, b=b: b(add_rms_norm_linear(x, res, nw, 1e-5, a, silu_mul=True)[0]) for a, b in mlp],
            [lambda a=a, b=b: b(_silu(a(add_rms_norm(x, res, nw, 1e-5, rh2, sh2)[0]), ri, si)) for a, b in mlp],
            [lambda a=a, b=b: b(rotate(_silu(a(rotate(add_rms_norm(x, res, nw, 1e-5)[0], rh2, sh2))), ri, si))
             for a, b in mlp]),
        "down alone (SiLU * up + down)": (
            [lambda b=b: b(silu_mul(g, u)) for b in down],
            [lambda b=b: b(silu_mul(g, u, ri, si)) for b in down],
            [lambda b=b: b(rotate(silu_mul(g, u), ri, si)) for b in down]),
    }
    out = {}
    for name, (plain, fused, separate) in cases.items():
        t = [time_calls(c).us for c in (plain, fused, separate)]
        out[name] = t
        log(f"| {M} | {name} | {t[0]:.2f} | {t[1]:.2f} | {t[1] - t[0]:+.2f} ({100 * (t[1] - t[0]) / t[0]:+.1f}%) | "
            f"{t[2]:.2f} ({100 * (t[2] - t[0]) / t[0]:+.1f}%) |")
    del qkv, o, gu, down, mlp
    torch.cuda.empty_cache()
    return out


def _silu(gu, rot=None, signs=None):
    n = gu.shape[1] // 2
    return silu_mul(gu[:, :n], gu[:, n:], rot, signs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32, help="decoder layers of the decode-step model")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="4 layers, and the parts at M = 1 only")
    ap.add_argument("--skip-step", action="store_true", help="the parts only")
    ap.add_argument("--profile", action="store_true", help="also the top kernels of one eager step of each model")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    if args.quick:
        args.layers = 4
    log(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; k = {args.k}, bf16, "
        f"KbitLinear.forward_rotated: {'own' if hasattr(KbitLinear, 'forward_rotated') else 'stand-in'}")
    if not args.skip_step:
        log(f"\n## decode step, Llama-3-8B shapes, {args.layers} layers, batch 1, ctx {args.ctx}, CUDA graph "
            f"({args.steps} steps, median of {args.reps})\n")
        log("| model | ms/step | min | max | logits finite |")
        log("|---|--:|--:|--:|---|")
        decode_step(args)
    l2 = l2_bytes()

    def copies_for(N, K):  # weight copies for cold L2 at M = 1 (k-bit bytes ~ N * K * (k + 0.25) / 8)
        return copies_for_cold_l2(int(N * K * (args.k + 0.25) / 8), l2)

    log("\n## a decoder layer's parts: producer + layer(s), unrotated vs fused rotation vs rotate() + layer "
        "(CUDA-graph replay, median of 15)\n")
    log("| M | part | unrotated us | fused rotation us (added) | rotate() + layer us (added) |")
    log("|--:|---|--:|--:|--:|")
    for M in (1,) if args.quick else (1, 1024):
        res = parts(M, args.k, copies_for if M == 1 else (lambda N, K: 1))
        main_parts = ("attention input", "o_proj", "MLP")
        u = sum(res[p][0] for p in main_parts)
        f = sum(res[p][1] for p in main_parts)
        log(f"| {M} | layer (attention input + o_proj + MLP; attention itself not included) | {u:.2f} | {f:.2f} "
            f"({100 * (f - u) / u:+.1f}%) | |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "rotation_step_cost.log").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
