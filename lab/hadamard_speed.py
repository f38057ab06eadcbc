"""GPU lab: what the standalone online Hadamard transform (``kbit.ops.hadamard.rotate``) costs, next to the k-bit
layers whose inputs it rotates (issue 35: <= 3% of the batch-1 decode step, <= 5% at M = 1024).

1. ``rotate`` alone at M = 1 and M = 1024 for K in (4096, 5120, 14336, 28672) (CUDA-graph replay, x hot in L2 as
   it is right after the kernel that wrote it): microseconds, and the bandwidth of its read + write.
2. Per layer (k = 3, bf16, cold-L2 weights, graphs): the layer alone, ``rotate`` then the layer in one graph (the
   real added cost, launch gap and PDL overlap included), and the added fraction. The weights are not rotated:
   the layer's speed does not depend on their values.
3. A Llama-3-8B-shaped decoder layer's linears at M = 1 and M = 1024: q/k/v (one rotation), o_proj, gate/up (one
   rotation), down_proj: four rotations (three at K = 4096, one at K = 14336) against the four linears' time (the
   step also has attention and norms, so the fraction of the whole step is lower than this).

    PYTHONPATH=src python lab/hadamard_speed.py [--k 3] [--quick] [--sweep] [--out DIR]
"""
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402

from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402
from kbit.format import Rotation  # noqa: E402
from kbit.nn import KbitLinear  # noqa: E402
from kbit.ops.hadamard import HadamardConfig, hadamard_config, rotate, rotate_reference, rotation_signs  # noqa: E402

LINES: list = []
ROTATE_K = (4096, 5120, 14336, 28672)
#: (name, N, K): Llama-3-8B's linears, plus a K = 5120 (Qwen2.5-14B q/k/v) and a K = 28672 (Llama-3-70B down_proj)
LAYERS = (("qkv 8B", 6144, 4096), ("o_proj 8B", 4096, 4096), ("gate_up 8B", 28672, 4096),
          ("down 8B", 4096, 14336), ("qkv 14B", 7168, 5120), ("down 70B", 8192, 28672))
STEP_8B = ("qkv 8B", "o_proj 8B", "gate_up 8B", "down 8B")  # each of the four inputs rotated once


def log(s=""):
    print(s, flush=True)
    LINES.append(s)


def rotate_alone(M, K, dt):
    r = Rotation.for_width(K, seed=1)
    x = torch.randn(M, K, device="cuda", dtype=dt)
    s = rotation_signs(r, K, x.device)
    ref = rotate_reference(x[:8].double().cpu(), r)  # a few rows against the float64 reference, before timing
    err = float(((rotate(x, r, s)[:8].double().cpu() - ref).abs().amax(-1) / ref.abs().amax(-1)).max())
    t = time_calls([lambda: rotate(x, r, s)])
    cfg = hadamard_config(M, K, r.block)
    gbs = 2 * x.numel() * x.element_size() / t.us / 1e3
    log(f"| {M} | {K} | {r.block} | {cfg.block_m}x{cfg.cols}, {cfg.num_warps} warps | {t.us:.2f} | {gbs:.0f} | "
        f"{err:.1e} | {t.mode} |")
    return t.us


def sweep(M, K, dt):
    """``rotate`` under pinned tiles (elements a program x warps): the data for tuning ``hadamard_config``."""
    r = Rotation.for_width(K, seed=1)
    x = torch.randn(M, K, device="cuda", dtype=dt)
    s = rotation_signs(r, K, x.device)
    ref = rotate(x, r, s)
    best, seen = None, set()
    for tile in (1024, 2048, 4096, 8192, 16384):
        if tile < r.block:
            continue
        cols = max(r.block, min(1 << (K - 1).bit_length(), tile))
        bm = max(1, min(1 << (M - 1).bit_length(), tile // cols))
        for warps in (2, 4, 8, 16):
            cfg = HadamardConfig(bm, cols, warps)
            if bm * cols < 32 * warps or cfg in seen:
                continue
            seen.add(cfg)
            assert torch.equal(rotate(x, r, s, config=cfg), ref), cfg
            us = time_calls([lambda c=cfg: rotate(x, r, s, config=c)]).us
            best = min(best or (us, cfg), (us, cfg), key=lambda b: b[0])
            log(f"| {M} | {K} | {bm}x{cols} | {warps} | {us:.2f} |")
    log(f"| {M} | {K} | best {best[1].block_m}x{best[1].cols} | {best[1].num_warps} | {best[0]:.2f} |")


def layer_times(name, N, K, M, k, dt):
    """(layer us, rotate + layer us) with cold-L2 weight copies."""
    torch.manual_seed(N + K)
    lin = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=dt)
    q0 = KbitLinear.from_linear(lin, k=k).repack_for_kernels()
    del lin
    per_copy = sum(t.numel() * t.element_size() for t in q0.buffers())
    n = copies_for_cold_l2(per_copy, l2_bytes())
    qs = [q0] + [KbitLinear.from_linear(torch.nn.Linear(K, N, bias=False, device="cuda", dtype=dt), k=k)
                 .repack_for_kernels() for _ in range(n - 1)]
    r = Rotation.for_width(K, seed=2)
    x = torch.randn(M, K, device="cuda", dtype=dt)
    s = rotation_signs(r, K, x.device)
    plain = time_calls([lambda q=q: q(x) for q in qs]).us
    rotated = time_calls([lambda q=q: q(rotate(x, r, s)) for q in qs]).us
    del qs, q0
    torch.cuda.empty_cache()
    log(f"| {name} | {N}x{K} | {M} | {plain:.2f} | {rotated:.2f} | {rotated - plain:+.2f} | "
        f"{100 * (rotated - plain) / plain:+.1f}% |")
    return plain, rotated


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="M = 1 only, and the 8B layers only")
    ap.add_argument("--sweep", action="store_true", help="also time rotate() under pinned tiles (tuning data)")
    ap.add_argument("--out", default=os.environ.get("OUT"))
    args = ap.parse_args()
    dt = torch.bfloat16
    ms = (1,) if args.quick else (1, 1024)
    log(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; k = {args.k}, {dt}, CUDA-graph replay, "
        "median of 15")
    log("\n## rotate() alone (x hot in L2)\n")
    log("| M | K | block | tile | us | GB/s (read + write) | max error / row max | mode |")
    log("|--:|--:|--:|---|--:|--:|--:|---|")
    alone = {(M, K): rotate_alone(M, K, dt) for M in ms for K in ROTATE_K}
    if args.sweep:
        log("\n## rotate() under pinned tiles\n")
        log("| M | K | tile (rows x cols) | warps | us |")
        log("|--:|--:|---|--:|--:|")
        for M in ms:
            for K in ROTATE_K:
                sweep(M, K, dt)
    log("\n## a layer, and rotate() + the layer in one graph (cold-L2 weights)\n")
    log("| layer | N x K | M | layer us | rotate + layer us | added us | added |")
    log("|---|---|--:|--:|--:|--:|--:|")
    layers = [lay for lay in LAYERS if not args.quick or lay[0] in STEP_8B]
    res = {(name, M): layer_times(name, N, K, M, args.k, dt) for M in ms for name, N, K in layers}
    log("\n## Llama-3-8B decoder layer, the four linears (four rotations: three at K = 4096, one at K = 14336)\n")
    log("| M | linears us | linears with rotations us | added | rotate() alone x4 us | as a fraction |")
    log("|--:|--:|--:|--:|--:|--:|")
    for M in ms:
        plain = sum(res[(n, M)][0] for n in STEP_8B)
        rot = sum(res[(n, M)][1] for n in STEP_8B)
        alone4 = 3 * alone[(M, 4096)] + alone[(M, 14336)]
        log(f"| {M} | {plain:.2f} | {rot:.2f} | {100 * (rot - plain) / plain:+.1f}% | {alone4:.2f} | "
            f"{100 * alone4 / plain:.1f}% |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "hadamard_speed.log").write_text("\n".join(LINES) + "\n")


if __name__ == "__main__":
    main()
