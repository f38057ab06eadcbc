"""GPU A/B: the decode step's rotary + KV append fused into the attention launch
(``kbit.ops.attention.rope_decode_attention``) against the unfused pair (``kbit.ops.glue.rope_append``, then
``decode_attention`` with ``new_from`` and arrival counters, as ``kbit.hf.fast_decode`` ran them before), one process.

    PYTHONPATH=src PYTHONUNBUFFERED=1 python lab/attn_rope_ab.py [--ctx 512,4096] [--batch 1,16] [--k 4] [--out DIR]

Shapes (D = 128, hidden 4096): Llama-3-8B (32 q / 8 KV heads), Qwen3-8B (32 / 8, per-head q/k RMSNorm), GQA-5
(40 / 8). For each shape, context (the step's position) and batch:

1. Check: both paths from the same caches; the cache entries they write (bits), their outputs against each other
   and against the float64 reference (``rope_decode_attention_reference``).
2. Time: one CUDA graph of ``n`` layers (``n`` copies of weights and caches, enough for a cold L2), each layer
   ``qkv GEMV -> [rope_append ->] attention -> o_proj GEMV`` with k-bit ``KbitLinear`` projections (they trigger
   programmatic dependent launch, so what the attention and rope_append load before their PDL wait overlaps the
   GEMV before them, as in the decode step); ``kbit.bench.timing.time_calls``, median of 15 replays, us a layer.

Prints the checks as they run and a table last: us a layer (old, new), saved, new / old. ``--out`` (default $OUT):
``attn_rope_ab.json``. ``--tiny``: a CPU smoke run of the checks (Triton interpreter, tiny shapes, no timing).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402
from kbit.nn import KbitLinear  # noqa: E402
from kbit.ops.attention import decode_attention, rope_decode_attention, rope_decode_attention_reference  # noqa: E402
from kbit.ops.glue import rope_append  # noqa: E402

MODELS = {"llama3-8b": (32, 8, False), "qwen3-8b": (32, 8, True), "gqa5": (40, 8, False)}  # (Hq, Hkv, q/k norms)
HIDDEN, D, EPS = 4096, 128, 1e-6
MAX_LAYERS = 24  # copies of weights and caches in the timed graph (memory at batch 16, context 4096: 2 suffice)
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


class Layer:
    """One attention layer's tensors: k-bit qkv and o projections, the static caches, q/k norm weights."""

    def __init__(self, Hq, Hkv, norm, B, L, k, dev, dt, hidden, d, seed):
        torch.manual_seed(seed)
        self.Hq, self.Hkv = Hq, Hkv
        self.qkv = KbitLinear.from_linear(torch.nn.Linear(hidden, (Hq + 2 * Hkv) * d, bias=False, device=dev,
                                                          dtype=dt), k=k)
        self.o = KbitLinear.from_linear(torch.nn.Linear(Hq * d, hidden, bias=False, device=dev, dtype=dt), k=k)
        if dev == "cuda":
            self.qkv.repack_for_kernels()
            self.o.repack_for_kernels()
        self.kc = torch.randn(B, Hkv, L, d, device=dev, dtype=dt)
        self.vc = torch.randn(B, Hkv, L, d, device=dev, dtype=dt)
        self.norms = ((1 + 0.1 * torch.randn(d, device=dev)).to(dt), (1 + 0.1 * torch.randn(d, device=dev)).to(dt),
                      EPS) if norm else ()

    def nbytes(self) -> int:
        mods = sum(t.numel() * t.element_size() for m in (self.qkv, self.o) for t in m.buffers())
        return mods + 2 * self.kc.numel() * self.kc.element_size()

    def split(self, qkv, d):
        nq, nk = self.Hq * d, self.Hkv * d
        return qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]


def old_attention(lay, q, k, v, cos, sin, pos, length, counters, d):
    qr = rope_append(q, k, v, cos, sin, pos, lay.kc, lay.vc, *lay.norms)
    return decode_attention(qr.view(q.shape[0], lay.Hkv, -1, d), lay.kc, lay.vc, length=length, new_from=pos,
                            scale=d ** -0.5, counters=counters)


def new_attention(lay, q, k, v, cos, sin, pos, length, counters, d):
    return rope_decode_attention(q, k, v, cos, sin, pos, lay.kc, lay.vc, *lay.norms, scale=d ** -0.5,
                                 counters=counters)


def check(lay, x, cos, sin, pos, length, counters, d) -> dict:
    """Both paths from the same caches: cache bits at pos, outputs against each other and float64."""
    kc0, vc0 = lay.kc.clone(), lay.vc.clone()
    q, k, v = lay.split(lay.qkv(x), d)
    old = old_attention(lay, q, k, v, cos, sin, pos, length, counters, d)
    k_old, v_old = lay.kc.clone(), lay.vc.clone()
    lay.kc.copy_(kc0)
    lay.vc.copy_(vc0)
    new = new_attention(lay, q, k, v, cos, sin, pos, length, counters, d)
    p = int(pos)
    k_diff = (lay.kc[:, :, p].view(torch.int16) != k_old[:, :, p].view(torch.int16)).sum().item()
    v_same = torch.equal(lay.vc.view(torch.int16), v_old.view(torch.int16))
    rest_same = torch.equal(lay.kc[:, :, :p].view(torch.int16), kc0[:, :, :p].view(torch.int16)) and \
        torch.equal(lay.kc[:, :, p + 1:].view(torch.int16), kc0[:, :, p + 1:].view(torch.int16))
    dd = [t.double() if t.is_floating_point() else t for t in (q, k, v, cos, sin, pos, kc0, vc0)]
    norms = [t.double() if isinstance(t, torch.Tensor) else t for t in lay.norms]
    ref = rope_decode_attention_reference(*dd, *norms, scale=d ** -0.5, out_dtype=torch.float64)
    err = lambda a: ((a.double() - ref).abs() / (1 + ref.abs())).max().item()  # noqa: E731
    return dict(k_bits_differ=k_diff, k_elems=lay.kc[:, :, p].numel(), v_equal=v_same, other_keys_kept=rest_same,
                new_vs_old=(new.double() - old.double()).abs().max().item(), old_err=err(old), new_err=err(new),
                counters_zero=bool(counters.eq(0).all()))


def run_case(model, B, ctx, args, dev, dt, hidden, d) -> dict:
    Hq, Hkv, norm = MODELS[model]
    if args.tiny:
        Hq, Hkv = Hq // 4, Hkv // 4
    L = ctx + 16
    first = Layer(Hq, Hkv, norm, B, L, args.k, dev, dt, hidden, d, seed=0)
    n = 1 if args.tiny else min(MAX_LAYERS, copies_for_cold_l2(first.nbytes(), l2_bytes()))
    layers = [first] + [Layer(Hq, Hkv, norm, B, L, args.k, dev, dt, hidden, d, seed=i) for i in range(1, n)]
    ang = torch.arange(L, device=dev, dtype=torch.float64)[:, None] * \
        (500000.0 ** (-torch.arange(0, d, 2, device=dev, dtype=torch.float64) / d))[None]
    cos, sin = (torch.cat([f(ang), f(ang)], -1).to(dt) for f in (torch.cos, torch.sin))
    pos = torch.tensor([ctx], device=dev)
    length = pos + 1  # the unfused path's valid length, made once a step (fast_decode did so)
    counters = torch.zeros(B * Hkv, dtype=torch.int32, device=dev)
    x = torch.randn(B, hidden, device=dev, dtype=dt)
    row = dict(model=model, batch=B, ctx=ctx, layers=n, **check(first, x, cos, sin, pos, length, counters, d))
    ok = row["k_bits_differ"] <= (row["k_elems"] // 100 if norm else 0) and row["v_equal"] and \
        row["other_keys_kept"] and row["counters_zero"] and row["new_err"] < 2e-2
    row["ok"] = ok
    log(f"{model:10s} b{B:<3d} ctx{ctx:<5d} check {'ok ' if ok else 'BAD'}: k bits differ {row['k_bits_differ']}/"
        f"{row['k_elems']}, v equal {row['v_equal']}, other keys kept {row['other_keys_kept']}, |new - old| "
        f"{row['new_vs_old']:.3g}, err vs float64 old {row['old_err']:.3g} new {row['new_err']:.3g}")
    if args.tiny:
        return row

    def layer_call(lay, attend):
        def call():
            q, k, v = lay.split(lay.qkv(x), d)
            return lay.o(attend(lay, q, k, v, cos, sin, pos, length, counters, d).reshape(B, -1))
        return call

    for name, fn in (("old", old_attention), ("new", new_attention)):
        row[f"{name}_us"] = time_calls([layer_call(lay, fn) for lay in layers]).us
    row["gemvs_us"] = time_calls([(lambda lay=lay: lay.o(lay.split(lay.qkv(x), d)[0].contiguous()))
                                  for lay in layers]).us  # the two GEMVs with one copy between, no attention
    log(f"{model:10s} b{B:<3d} ctx{ctx:<5d} {n} layers: old {row['old_us']:.2f} us, new {row['new_us']:.2f} us a "
        f"layer (GEMVs alone {row['gemvs_us']:.2f})")
    del layers, first
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ctx", default="512,4096")
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT"))
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run of the checks (interpreter, tiny shapes)")
    args = ap.parse_args()
    if args.tiny:
        dev, dt, hidden, d = "cpu", torch.float16, 64, 16
        ctxs, batches = [0, 31], [1, 3]
    else:
        if not torch.cuda.is_available():
            print("needs a CUDA GPU (or --tiny)")
            return 2
        dev, dt, hidden, d = "cuda", torch.bfloat16, HIDDEN, D
        ctxs, batches = [int(c) for c in args.ctx.split(",")], [int(b) for b in args.batch.split(",")]
        log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, k = {args.k}, bf16")
    rows = [run_case(m, B, c, args, dev, dt, hidden, d) for m in args.models.split(",") for c in ctxs
            for B in batches]
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "attn_rope_ab.json").write_text(json.dumps(rows, indent=1))
    print("\nus a layer (qkv GEMV -> rope + attention -> o_proj GEMV; old: rope_append then decode_attention, new: "
          "rope_decode_attention)")
    print(f"{'model':10s} {'B':>3s} {'ctx':>5s} {'check':>5s} {'old us':>8s} {'new us':>8s} {'saved':>7s} "
          f"{'new/old':>7s} {'GEMVs':>7s}")
    for r in rows:
        old, new = r.get("old_us", math.nan), r.get("new_us", math.nan)
        print(f"{r['model']:10s} {r['batch']:3d} {r['ctx']:5d} {'ok' if r['ok'] else 'BAD':>5s} {old:8.2f} "
              f"{new:8.2f} {old - new:7.2f} {new / old:7.3f} {r.get('gemvs_us', math.nan):7.2f}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
