"""GPU lab for the GEMV kernels: correctness against float64, then cold-L2 timings of many configs in one call.

    PYTHONUNBUFFERED=1 python lab/gemv_lab.py [--quick] [--budget SECONDS] [--out DIR]

Writes ``lab.log`` and ``lab.json`` under ``--out`` (default ``$OUT`` or ``.``) and prints a short table last.
Timing: ``kbit.bench.timing.time_calls`` (CUDA graph over weight copies that together exceed 8x L2).
Bytes counted: codes + scales + codebook + tensor_scale (the read ceiling is the harness's ``x.sum()``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import types
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
if "kbit" not in sys.modules:  # import the subpackages without the package __init__ (may be mid-edit)
    _pkg = types.ModuleType("kbit")
    _pkg.__path__ = [str(ROOT / "src" / "kbit")]
    sys.modules["kbit"] = _pkg

import torch  # noqa: E402

from kbit.bench.timing import copies_for_cold_l2, l2_bytes, time_calls  # noqa: E402
from kbit.ops import gemv as G  # noqa: E402
from kbit.tuning.gemv import GemvConfig, heuristic  # noqa: E402

DENSE = [(28672, 4096), (4096, 14336), (57344, 8192), (8192, 28672)]
T0 = time.time()
LOG = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


def rand_weight(N, K, k, B=32, sf="log8", lead=(), seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    Kp = -(-K // B) * B
    codes = torch.randint(-(2**31), 2**31 - 1, (*lead, N, Kp * k // 32), generator=g, dtype=torch.int32,
                          device="cuda")
    if sf == "log8":
        scales = torch.randint(0, 64, (*lead, N, Kp // B), generator=g, dtype=torch.uint8, device="cuda")
        ts = torch.rand(lead, generator=g, device="cuda") + 0.5
    else:
        scales = (torch.rand(*lead, N, Kp // B, generator=g, device="cuda") + 0.05).half()
        ts = torch.ones(lead, device="cuda")
    cb = torch.sort(torch.rand(2**k, generator=g, device="cuda") * 2 - 1).values
    return codes, scales, ts, cb


def nbytes(w):
    return sum(t.numel() * t.element_size() for t in w)


def rel_err(y, ref):
    if torch.isnan(y).any():
        return float("nan")
    return ((y.double() - ref).norm() / ref.norm()).item()


# ------------------------------------------------------------------------------------------ correctness
def correctness(quick):
    fails = []
    cases = []
    for k in (2, 3, 4, 5):
        for dt in (torch.float16, torch.bfloat16):
            for M in ((1, 8) if quick else (1, 3, 8)):
                cases.append((2880, 5120, k, M, dt, 32, "log8"))
    cases += [(28672, 1024, k, M, torch.bfloat16, 32, "log8") for k in (2, 3, 4, 5) for M in (1, 8)]  # many tiles
    cases += [(18944, 1, 4, 1, torch.float16, 32, "log8"), (1, 18944, 3, 2, torch.bfloat16, 32, "log8"),
              (5120, 2880, 5, 4, torch.bfloat16, 64, "fp16"), (4096, 4096, 2, 1, torch.float16, 128, "log8")]
    for N, K, k, M, dt, B, sf in cases:
        w = rand_weight(N, K, k, B, sf, seed=N + K + k)
        x = torch.randn(M, K, dtype=dt, device="cuda")
        torch.full((M, N), float("nan"), dtype=dt, device="cuda")  # poison the allocator's next block
        kw = dict(k=k, blocksize=B, scale_format=sf, N=N, K=K)
        try:
            y = G.gemv(x, *w, **kw)
            e = rel_err(y, G.gemv_reference(x, *w, **kw))
        except Exception as ex:  # noqa: BLE001
            log(f"check dense N={N} K={K} k={k} M={M}: FAILED {repr(ex)[:400]}")
            fails.append((N, K, k, M, "exception"))
            continue
        ok = e < (2e-3 if dt == torch.float16 else 1.2e-2)
        log(f"check dense N={N} K={K} k={k} M={M} {str(dt)[6:]} B={B} {sf}: rel err {e:.2e} {'ok' if ok else 'FAIL'}")
        if not ok:
            fails.append((N, K, k, M, str(dt), B, sf, e))
    # grouped
    E, N, K = 16, 1536, 2048
    for k in (2, 3, 4, 5):
        w = rand_weight(N, K, k, lead=(E,), seed=k)
        x = torch.randn(4, K, dtype=torch.bfloat16, device="cuda")
        tok = torch.arange(4, device="cuda", dtype=torch.int32).repeat_interleave(8)
        exp = torch.randint(0, E, (32,), device="cuda", dtype=torch.int32)
        kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K)
        y = G.grouped_gemv(x, tok, exp, *w, **kw)
        e = rel_err(y, G.grouped_gemv_reference(x, tok, exp, *w, **kw))
        ok = e < 1.2e-2
        log(f"check grouped k={k}: rel err {e:.2e} {'ok' if ok else 'FAIL'}")
        if not ok:
            fails.append(("grouped", k, e))
    return fails


# ------------------------------------------------------------------------------------------ timing
def time_dense(N, K, k, M, dtype, cfg, copies_cache):
    key = (N, K, k)
    if key not in copies_cache:
        copies_cache.clear()
        torch.cuda.empty_cache()
        one = rand_weight(N, K, k)
        n = copies_for_cold_l2(nbytes(one), l2_bytes())
        copies_cache[key] = [one] + [rand_weight(N, K, k, seed=i + 1) for i in range(n - 1)]
    ws = copies_cache[key]
    x = torch.randn(M, K, dtype=dtype, device="cuda")
    kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K, config=cfg)
    calls = [(lambda w=w: G.gemv(x, *w, **kw)) for w in ws]
    t = time_calls(calls)
    return t.us, nbytes(ws[0])


def time_grouped(E, N, K, k, T, cfg, seed=0):
    torch.manual_seed(seed)
    ws = [rand_weight(N, K, k, lead=(E,), seed=i) for i in range(3)]
    x = torch.randn(T, K, dtype=torch.bfloat16, device="cuda")
    scores = torch.rand(T, E, device="cuda")
    exp = scores.topk(8, dim=1).indices.to(torch.int32).flatten()
    tok = torch.arange(T, device="cuda", dtype=torch.int32).repeat_interleave(8)
    kw = dict(k=k, blocksize=32, scale_format="log8", N=N, K=K, config=cfg)
    calls = [(lambda w=w: G.grouped_gemv(x, tok, exp, *w, **kw)) for w in ws]
    t = time_calls(calls)
    touched = exp.unique().numel()
    per_expert = nbytes(ws[0][:2]) / E
    return t.us, touched * per_expert + 4 * 2**k


def bf16_grouped(E, N, K, T, seed=0):
    """torch._grouped_mm over the same routing (bf16 weights [E, K, N]); None if unavailable."""
    if not hasattr(torch, "_grouped_mm"):
        return None
    torch.manual_seed(seed)
    ws = [torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)]
    x = torch.randn(T, K, dtype=torch.bfloat16, device="cuda")
    exp = torch.rand(T, E, device="cuda").topk(8, dim=1).indices.flatten()
    order = exp.argsort()
    xs = x.repeat_interleave(8, dim=0)[order].contiguous()
    counts = torch.bincount(exp, minlength=E)
    offs = counts.cumsum(0).to(torch.int32)
    try:
        calls = [(lambda w=w: torch._grouped_mm(xs, w, offs=offs)) for w in ws]
        return time_calls(calls).us
    except Exception as e:  # noqa: BLE001
        log("grouped_mm failed:", repr(e)[:200])
        return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget", type=float, default=380)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    res["triton"] = triton.__version__
    log("device", res)
    ceiling = 3.07
    try:
        from kbit.bench.ceiling import measure_read_ceiling

        ceiling = measure_read_ceiling().read_tbps
    except Exception as e:  # noqa: BLE001
        log("ceiling failed", repr(e)[:200])
    res["ceiling_tbps"] = ceiling
    log(f"read ceiling {ceiling:.3f} TB/s  ({time.time() - T0:.0f}s)")

    res["fails"] = correctness(args.quick)
    log(f"correctness: {len(res['fails'])} failures ({time.time() - T0:.0f}s)")

    def left():
        return args.budget - (time.time() - T0)

    cache = {}
    rows = []
    # A. policy sweep, M = 1, fp16, first two shapes (long-N, long-K), k = 4 and 2. A policy maps the shape to
    # a config: the heuristic's tile with other pipeline depths / programs per SM, or a fixed tile.
    def pol(**kw):
        return lambda N, K, k, M: replace(heuristic(k, M, N, K), **kw)

    def fixed(BN, G, W, S, pps):
        return lambda N, K, k, M: GemvConfig(BN, G, W, num_stages=S, pps=pps)

    policies = {"heur": pol(), "S3": pol(num_stages=3), "S6": pol(num_stages=6), "pps4": pol(pps=4),
                "pps12": pol(pps=12), "grid": pol(pps=0), "8x16": fixed(8, 16, 4, 4, 8),
                "4x32": fixed(4, 32, 4, 4, 8), "16x16w8": fixed(16, 16, 8, 4, 4),
                "G2x": lambda N, K, k, M: (lambda c: replace(c, G=2 * c.G, pps=max(4, c.pps // 2)))(
                    heuristic(k, M, N, K))}
    if args.quick:
        policies = {k_: policies[k_] for k_ in ("heur", "S3", "pps4", "grid", "G2x")}
    best = {}
    for k in (4, 2):
        for N, K in DENSE[:2]:
            for name, fn in policies.items():
                if left() < 150:
                    break
                cfg = fn(N, K, k, 1)
                try:
                    us, nb = time_dense(N, K, k, 1, torch.float16, cfg, cache)
                except Exception as e:  # noqa: BLE001
                    log(f"sweep {N}x{K} k={k} {name} {cfg}: FAILED {repr(e)[:300]}")
                    continue
                tb = nb / us / 1e6
                rows.append(dict(kind="sweep", N=N, K=K, k=k, M=1, dtype="fp16", policy=name, cfg=cfg.as_dict(),
                                 us=us, tbps=tb))
                log(f"sweep {N}x{K} k={k} {name} {cfg}: {us:.2f} us {tb:.3f} TB/s {100 * tb / ceiling:.0f}%")
                best.setdefault(k, {}).setdefault(name, 0.0)
                best[k][name] += us
    best_pol = {k: min(v, key=v.get) for k, v in best.items()}
    best_pol[3] = best_pol.get(2, "heur")
    best_pol[5] = best_pol.get(4, "heur")
    log("best policies:", best_pol)
    res["best_policy"] = best_pol
    # B. all shapes, M = 1 (fp16, bf16), 2, 4, 8 (fp16) with the best policy of each k
    for k in (4, 2, 3, 5):
        fn = policies.get(best_pol.get(k, "heur"), policies["heur"])
        for N, K in DENSE + [(4096, 4096)]:
            for M, dt in ((1, torch.float16), (1, torch.bfloat16), (2, torch.float16), (4, torch.float16),
                          (8, torch.float16)):
                if left() < 60 or (dt == torch.bfloat16 and k != 4):
                    continue
                cfg = fn(N, K, k, M)
                try:
                    us, nb = time_dense(N, K, k, M, dt, cfg, cache)
                except Exception as e:  # noqa: BLE001
                    log(f"dense {N}x{K} k={k} M={M}: FAILED {repr(e)[:300]}")
                    continue
                tb = nb / us / 1e6
                rows.append(dict(kind="dense", N=N, K=K, k=k, M=M, dtype=str(dt)[6:], cfg=str(cfg), us=us,
                                 tbps=tb))
                log(f"dense {N}x{K} k={k} M={M} {str(dt)[6:]} {cfg}: {us:.2f} us {tb:.3f} TB/s "
                    f"{100 * tb / ceiling:.0f}%")
    cache.clear()
    torch.cuda.empty_cache()
    # C. grouped (Qwen3-30B-A3B experts), k = 4, bf16
    for name, (N, K) in (("gate_up", (1536, 2048)), ("down", (2048, 768))):
        for T in (1, 4):
            ref = bf16_grouped(128, N, K, T) if left() > 30 else None
            hc = heuristic(4, 1, N, K, grouped=True)
            for cfg in (None, replace(hc, pps=4), replace(hc, pps=0), replace(hc, BN=hc.BN // 2, G=hc.G * 2)):
                if left() < 20:
                    break
                try:
                    us, nb = time_grouped(128, N, K, 4, T, cfg)
                except Exception as e:  # noqa: BLE001
                    log(f"grouped {name} T={T} {cfg}: FAILED {repr(e)[:300]}")
                    continue
                tb = nb / us / 1e6
                rows.append(dict(kind="grouped", name=name, N=N, K=K, k=4, T=T, cfg=str(cfg), us=us, tbps=tb,
                                 bf16_us=ref))
                log(f"grouped {name} T={T} {cfg}: {us:.2f} us {tb:.3f} TB/s {100 * tb / ceiling:.0f}% "
                    f"bf16 grouped_mm {ref if ref is None else f'{ref:.2f}'} us")
    res["rows"] = rows
    (out / "lab.json").write_text(json.dumps(res, indent=1, default=str))
    (out / "lab.log").write_text("\n".join(LOG))
    # short table: dense M=1 per k and shape, M ratios, grouped best
    print("\n== summary (us / TB/s / % ceiling) ==")
    dense = [r for r in rows if r["kind"] == "dense"]
    for k in (2, 3, 4, 5):
        line = [f"k={k}"]
        for N, K in DENSE + [(4096, 4096)]:
            r1 = [r for r in dense if r["k"] == k and r["N"] == N and r["K"] == K and r["M"] == 1
                  and r["dtype"] == "float16"]
            if r1:
                r1 = r1[0]
                ms = []
                for M in (2, 4, 8):
                    rm = [r for r in dense if r["k"] == k and r["N"] == N and r["K"] == K and r["M"] == M]
                    ms.append(f"{rm[0]['us'] / r1['us']:.2f}" if rm else "-")
                line.append(f"{N}x{K}: {r1['us']:.1f} {r1['tbps']:.2f} {100 * r1['tbps'] / ceiling:.0f}% "
                            f"M2/4/8 x{'/'.join(ms)}")
        print(" | ".join(line))
    for name in ("gate_up", "down"):
        for T in (1, 4):
            g = [r for r in rows if r["kind"] == "grouped" and r["name"] == name and r["T"] == T]
            if g:
                b = min(g, key=lambda r: r["us"])
                sp = f"{b['bf16_us'] / b['us']:.2f}x" if b["bf16_us"] else "-"
                print(f"grouped {name} T={T}: {b['us']:.2f} us {b['tbps']:.2f} TB/s "
                      f"{100 * b['tbps'] / ceiling:.0f}% vs bf16 {sp} cfg {b['cfg']}")
    print(f"fails: {res['fails']}  elapsed {time.time() - T0:.0f}s")
    if math.isnan(ceiling):
        sys.exit(1)


if __name__ == "__main__":
    main()
