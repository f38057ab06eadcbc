"""GPU lab: the grouped (MoE) GEMMs of one token (T = 1, top_k pairs) on current MoE shapes, each grouped kernel
config against the dense M = 1 path on a matrix of the same bytes (the touched experts stacked: what the step would
take if the pairs ran as one dense GEMV), cold L2, CUDA graphs (``kbit.bench.timing.time_calls``).

    PYTHONUNBUFFERED=1 python lab/moe_t1_lab.py [--models ...] [--k 4] [--out DIR]

Prints a table of us and TB/s (bytes: the touched experts' codes and scales) per (model, gemm, variant) and writes
``moe_t1_lab.json`` under ``--out``. Checks each variant's output against the default config's (relative error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402
from kbit.ops import grouped_mma as GR  # noqa: E402
from kbit.ops import moe_blocks as MB  # noqa: E402
from kbit.ops.gemv_mma import launch_config, linear_small_m, pairs_linear  # noqa: E402
from kbit.tuning.mma import MmaConfig  # noqa: E402
from kbit.tuning.moe import GroupedMmaConfig  # noqa: E402

# (experts, top_k, hidden, expert intermediate) from the models' config.json
MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336),
          "qwen3-235b-a22b": (128, 8, 4096, 1536), "gpt-oss-120b": (128, 4, 2880, 2880),
          "glm-4.5-air": (128, 8, 4096, 1408), "deepseek-v3": (256, 8, 7168, 2048)}
VARIANTS = {"k1 w8 b2": GroupedMmaConfig(1, 1, 8, 2), "k1 w4 b4": GroupedMmaConfig(1, 1, 4, 4),
            "k1 w16 b1": GroupedMmaConfig(1, 1, 16, 1), "k4 w4 d2": GroupedMmaConfig(4, 1, 4, 1, 2),
            "k4 w4 d4": GroupedMmaConfig(4, 1, 4, 1, 4), "k4 w8 d3": GroupedMmaConfig(4, 1, 8, 1, 3)}
DENSE1 = {"dense k1 w4 b4": MmaConfig(1, 4, 4), "dense k1 w8 b2": MmaConfig(1, 8, 2)}


def stack(E, N, K, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Kp = -(-K // 32) * 32
    codes = torch.randint(-(2**31), 2**31 - 1, (E, N, Kp * k // 32), generator=g, dtype=torch.int32, device="cuda")
    scales = torch.randint(0, 64, (E, N, Kp // 32), generator=g, dtype=torch.uint8, device="cuda")
    ts = torch.rand(E, device="cuda", generator=g) * 0.01 + 0.005
    cb = torch.sort(torch.rand(2**k, device="cuda", generator=g) * 2 - 1).values
    return codes, scales, ts, cb


def parse_args(budget: float) -> argparse.Namespace:
    """The MoE GEMM labs' arguments (``--models``, ``--k``, ``--budget`` seconds, ``--out``), ``--out`` made."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budget", type=float, default=budget)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    Path(a.out).mkdir(parents=True, exist_ok=True)
    return a


def gemms(a: argparse.Namespace):
    """(model, gemm, E, top_k, N, K, bytes of one expert: codes + log8 scales) of ``a.models``, gate_up then down,
    until ``a.budget`` seconds have passed."""
    t0 = time.time()
    for name in a.models.split(","):
        E, top, H, I = MODELS[name]
        for gemm, (N, K) in (("gate_up", (2 * I, H)), ("down", (H, I))):
            if time.time() - t0 > a.budget:
                print("budget reached", flush=True)
                return
            yield name, gemm, E, top, N, K, N * K * a.k / 8 + N * -(-K // 32)


def main():
    a = parse_args(400)
    out = Path(a.out)
    k, rows_out = a.k, []
    for name, gemm, E, top, N, K, one in gemms(a):
        n_copies = copies_for_cold_l2(int(one * E), l2_bytes())
        stacks = [stack(E, N, K, k, seed=i) for i in range(n_copies)]
        ids = torch.randperm(E, device="cuda")[:top].to(torch.int32)
        if gemm == "gate_up":
            x, rows = torch.randn(1, K, device="cuda").bfloat16(), torch.zeros(top, dtype=torch.int32,
                                                                               device="cuda")
        else:
            x, rows = torch.randn(top, K, device="cuda").bfloat16(), torch.arange(top, dtype=torch.int32,
                                                                                  device="cuda")
        blocks = MB.block_table(ids, 8)
        kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K, blocks=blocks, checked=True)
        ref = GR.grouped_linear(x, rows, ids, *stacks[0], **kw).double()
        r = dict(model=name, gemm=gemm, N=N, K=K, P=top, mb=top * one / 1e6)
        for vname, cfg in [("default", None), *VARIANTS.items()]:
            try:
                y = GR.grouped_linear(x, rows, ids, *stacks[0], config=cfg, **kw).double()
                err = ((y - ref).norm() / ref.norm()).item()
                t = time_calls([(lambda s=s, cfg=cfg, x=x, rows=rows, ids=ids, kw=kw:
                                 GR.grouped_linear(x, rows, ids, *s, config=cfg, **kw)) for s in stacks])
                r[vname] = (t.us, top * one / t.us / 1e6, err)
            except Exception as ex:  # noqa: BLE001
                r[vname] = repr(ex)[:200]
        # the pairs as one dense GEMV over the stacked experts (kbit.ops.gemv_mma.pairs_linear)
        reps = [GR.repacked_stack(c, sc, k=k, blocksize=32, scale_format="log8", N=N, K=K)
                for c, sc, _, _ in stacks]
        pk = dict(k=k, scale_format="log8", N=N, K=K)
        y = pairs_linear(x, rows, ids, *reps[0], *stacks[0][2:], **pk)
        if y is None:
            r["pairs"] = "not applicable"
        else:
            err = ((y.double() - ref).norm() / ref.norm()).item()
            t = time_calls([(lambda rp=rp, s=s, x=x, rows=rows, ids=ids, pk=pk:
                             pairs_linear(x, rows, ids, *rp, *s[2:], **pk))
                            for rp, s in zip(reps, stacks, strict=True)])
            r["pairs"] = (t.us, top * one / t.us / 1e6, err)
        del stacks, reps
        # the dense M = 1 path on the touched experts' bytes: one [top N, K] matrix
        dn = [stack(1, top * N, K, k, seed=100 + i) for i in range(copies_for_cold_l2(int(top * one),
                                                                                   l2_bytes()))]
        dn = [(c[0], sc[0], ts[0], cb) for c, sc, ts, cb in dn]  # 2-D views made once: the repack is cached
        xd = torch.randn(1, K, device="cuda").bfloat16()
        dkw = dict(k=k, blocksize=32, scale_format="log8", N=top * N, K=K)
        t = time_calls([(lambda s=s, xd=xd, dkw=dkw: linear_small_m(xd, *s, **dkw)) for s in dn])
        r["dense M=1"] = (t.us, top * one / t.us / 1e6, 0.0)
        r["dense config"] = repr(launch_config(k, 1, top * N, K, "cuda"))
        for dname, dcfg in DENSE1.items():  # the dense kernel 1 (split K across CTAs) pinned
            t = time_calls([(lambda s=s, xd=xd, dkw=dkw, dcfg=dcfg: linear_small_m(xd, *s, config=dcfg, **dkw))
                            for s in dn])
            r[dname] = (t.us, top * one / t.us / 1e6, 0.0)
        del dn
        torch.cuda.empty_cache()
        rows_out.append(r)
        print(name, gemm, {kk: (v if isinstance(v, str) else f"{v[0]:.1f}us {v[1]:.2f}TB/s {v[2]:.0e}")
                           for kk, v in r.items() if isinstance(v, (str, tuple)) and kk not in ("model", "gemm")},
              flush=True)
        (out / "moe_t1_lab.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(),
                                                             commit=os.environ.get("KBIT_COMMIT", "?"),
                                                             rows=rows_out), indent=1))
    names = ["default", *VARIANTS, "pairs", "dense M=1", *DENSE1]
    print("\n| model | gemm | MB | " + " | ".join(names) + " |  (us, TB/s)")
    for r in rows_out:
        print(f"| {r['model']} | {r['gemm']} | {r['mb']:.1f} | " + " | ".join(
            (f"{r[n][0]:.1f} {r[n][1]:.2f}" if isinstance(r.get(n), tuple) else "err") for n in names) + " |")
    for r in rows_out:
        print(r["model"], r["gemm"], "dense path's config:", r["dense config"])


if __name__ == "__main__":
    main()
